"""Gradients: reduction into this rank's slices, the global norm, the loss scaler."""
