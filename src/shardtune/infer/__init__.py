"""Using a trained model: generation settings, answer metrics, ``shardtune chat``."""
