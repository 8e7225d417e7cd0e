"""Recipe runner for large-scale LLM training on TorchTitan's building blocks."""
