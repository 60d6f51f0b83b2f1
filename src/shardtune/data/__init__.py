"""Data layer: dataset registry, record formats, chat templates, tokenisation, packing and batching.

Typical use on every rank::

    train, evaluation = build_datasets(tokenizer, settings)
    collator = DataCollator(tokenizer.pad_token_id, attn_implementation=model.config._attn_implementation,
                            window_by_layer_type=layer_windows(model.config))  # shardtune.model.attention

and on the launching host, before spawning anything: ``check_data_settings(settings)``.
This package never imports ``torch.distributed``; callers decide which rank preprocesses first.
"""

# Everything is loaded on first use: build_datasets and DataCollator pull in `datasets` and torch, and
# `shardtune check` imports only the light modules it needs.
_LAZY = {"build_datasets": "shardtune.data.build", "DataCollator": "shardtune.data.collator",
         "check_data_settings": "shardtune.data.checks", "IGNORE_INDEX": "shardtune.data.settings",
         "DataSettings": "shardtune.data.settings", "TEMPLATES": "shardtune.data.templates",
         "Template": "shardtune.data.templates", "get_template": "shardtune.data.templates"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


__all__ = [
    "IGNORE_INDEX",
    "TEMPLATES",
    "DataCollator",
    "DataSettings",
    "Template",
    "build_datasets",
    "check_data_settings",
    "get_template",
]
