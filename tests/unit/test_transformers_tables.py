"""The tables and kernel attributes shardtune reads from transformers' source files (model/transformers_tables.py)
equal what importing transformers gives: the same auto tables, and for each causal-LM class the same kernels.

The make-test slice covers the families `make-tiny-model` builds; `make test-matrix` covers every causal-LM model
type of the installed transformers (a new release's families are checked without anyone naming them).
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from shardtune.model.architectures import FAMILIES
from shardtune.model.attention import KernelSupport, kernel_support, takes_prepared_mask
from shardtune.model.composite import image_text_class_name
from shardtune.model.transformers_tables import causal_lm_class_name, known_model_types, table
from tests.conftest import REPO


def imported_support(model_type: str) -> KernelSupport | None:
    """What the class says about itself once imported (the way shardtune decided before reading sources)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    try:
        cls = getattr(transformers, name) if name else None
    except (ImportError, AttributeError):  # a class whose extra dependency is missing here
        return None
    if cls is None:
        return None
    source = inspect.getsource(sys.modules[cls.__module__])
    return KernelSupport(cls.__name__, flash=bool(getattr(cls, "_supports_flash_attn", False)),
                         sdpa=bool(getattr(cls, "_supports_sdpa", False)), sinks="s_aux=" in source,
                         mask_per_layer_type="isinstance(causal_mask_mapping := attention_mask, dict)" in source,
                         prepared_mask=takes_prepared_mask(source, {"model_type": model_type}),
                         softcap="softcap=" in source,
                         attention_interface=bool(getattr(cls, "_supports_attention_backend", False)),
                         image_text=image_text_class_name({"model_type": model_type}) is not None)


def test_the_auto_tables_read_from_source_equal_the_imported_ones():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    assert known_model_types() == set(CONFIG_MAPPING_NAMES)
    assert table("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES") == dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert table("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES") == dict(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


@pytest.mark.parametrize("model_type", sorted({f.model_type for f in FAMILIES.values()}))
def test_kernel_support_read_from_source_equals_the_imported_class(model_type):
    assert kernel_support({"model_type": model_type}) == imported_support(model_type)


@pytest.mark.matrix
def test_kernel_support_of_every_causal_lm_in_the_registry():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    differ = {}
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        imported = imported_support(model_type)
        if imported is not None and kernel_support({"model_type": model_type}) != imported:
            differ[model_type] = (kernel_support({"model_type": model_type}), imported)
    assert not differ


def test_an_unknown_model_type_has_no_class():
    assert causal_lm_class_name("llama9") is None
    assert kernel_support({"model_type": "llama9"}) is None


def test_check_imports_no_heavy_library(tiny_model_dir, tmp_path):
    """`shardtune check` on the tiny example decides everything without importing torch, transformers or datasets
    (their import alone takes seconds; the benchmark of check's time is benchmarks/check_time.py)."""
    code = ("import sys; from shardtune.cli import main; "
            f"code = main(['check', 'examples/tiny/sft_lora.yaml', 'model_name_or_path={tiny_model_dir}', "
            f"'output_dir={tmp_path / 'out'}']); "
            "heavy = sorted(m for m in ('torch', 'transformers', 'datasets', 'peft', 'deepspeed') "
            "if m in sys.modules); "
            "print('HEAVY', heavy, code)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "HEAVY [] 0" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
