"""The Hugging Face door: `from_pretrained`, which uses the engine."""
