"""Export checkpoints and outputs to plain Hugging Face model folders."""
