"""shardtune: fine-tune LLMs from one process to many nodes."""

__version__ = "0.1.0"
