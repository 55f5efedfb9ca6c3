"""The engine: what `infinity.initialize` returns, the materialization of meta models, a step's metrics."""
