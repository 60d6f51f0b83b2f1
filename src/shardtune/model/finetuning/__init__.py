"""Fine-tuning setup: which parameters of a built model train, and the peft adapter when one does.

Start at apply.py (``apply_finetuning``), which reads top to bottom: what trains (the method), what stays frozen
(an image-text model's parts), what the adapter targets and what is refused. One module per method and per question:

    settings.py     FinetuningSettings and FrozenParts: the config keys that decide what trains
    apply.py        the entry: gradient checkpointing, the method, the frozen parts, NEFTune
    full.py         full (everything trains) and frozen (nothing: a preference run's reference model)
    freeze.py       freeze tuning: the last N decoder layers (LLaMA-Pro: the expanded blocks)
    adapter.py      what LoRA and OFT share: targets, peft's wrapping, layers saved in full, resuming
    targets.py      which layers an adapter wraps, and the targets it refuses (routers, absent names)
    exclusions.py   Linear layers no adapter can wrap, found per model with the reason
    image_text.py   an image-text model's frozen parts (tower, projector, language model)
    lora.py         LoRA's own: its peft config, its host initialisation, its casts under autocast
    oft.py          OFT's own: its sizes, its peft config, its host initialisation
    neftune.py      NEFTune's noise on the input embeddings
"""
