"""Optimizers and schedulers: the settings, the parameter groups, LLaMA-Factory's replacement optimizers."""
