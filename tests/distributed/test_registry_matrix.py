"""Every decoder family of transformers' registry on every engine (scripts/registry_engines.py): DDP LoRA, ZeRO-3
full and FSDP2 full on two gloo processes, each with the per-step losses of one process.

One two-process launch trains every family's cells in turn through shardtune's rank entry, one process every
reference (a ``shardtune train`` per cell would start torch, transformers and DeepSpeed again about 800 times). A
cell whose first step does not finish within the bound, or that fails, is that cell's failure and the next launch
goes on after it: the matrix never hangs.

Each family either passes every cell, or is refused before launch (``REFUSED``, the reason the preflight gives),
or its tiny config cannot be built (``NOT_BUILT``), or it fails a cell in ``FAILING`` with the reason. The tables
only shrink: a listed family that starts to pass fails the test until it is taken off. `make test` runs ``SLICE``;
`make test-matrix` every family (benchmarks/results/registry-engines-*.md is its table).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from shardtune.model.registry import decoder_families

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(7200)]

REPO = Path(__file__).resolve().parents[2]
TEST = "test_registry_family_trains_on_every_engine"
# A plain decoder, a hybrid with linear attention, latent attention with a sparse indexer, compressed attention
# whose compressor only long rows reach, a family refused for its class and one refused for what it is: about a
# minute on 2 cores.
SLICE = {"llama", "qwen3_next", "deepseek_v32", "deepseek_v4", "emu3", "musicgen"}
# The tiny config cannot be built from the family's defaults (transformers' own error while building it). Empty
# since 2026-11-28: 17 families build with model/registry.py's FAMILY_OVERRIDES, and the 6 that cannot are refused
# before launch from their config.json alone (below).
NOT_BUILT: dict[str, str] = {}
# Refused by `shardtune check`: CPM-Ant, whose forward attends both ways (the tiny model's earlier logits move
# when the last token changes: tests/unit/test_registry_families.py); saved with a text sub-config's model_type
# that AutoModelForCausalLM cannot build again (Emu3, Mllama); X-MOD without a default_language (every forward
# would raise "Input language unknown"); and
# model/folder.py's UNTRAINABLE_FAMILIES and timm towers, whose folders the matrix writes with the family's default
# config.json and no weights (scripts/registry_engines.py refused_as_downloaded): Gemma 3n's vision tower needs
# timm (which needs torchvision, a CUDA torch here), the Gemma 4 assistants are draft models that read the main
# model's embeddings and caches, MusicGen's causal LM is built from its composite config's decoder, Reformer trains
# only on rows exactly as long as its axial positions.
REFUSED: dict[str, str] = {
    "emu3": "has no causal-LM class",
    "mllama": "has no causal-LM class",
    "xmod": "X-MOD picks each row's language adapters from default_language",
    "gemma3n": "is a timm model, and timm is not installed",
    "gemma4_assistant": "a draft model for Gemma 4's speculative decoding",
    "gemma4_unified_assistant": "a draft model for Gemma 4's speculative decoding",
    "musicgen": "a text-to-music model",
    "musicgen_melody": "a text-to-music model",
    "cpmant": "attends in both directions",
    "reformer": "Reformer trains only on rows exactly as long as its axial position table",
}
# Open failures (issue 29 stays open for each), with the part of the reason the run gives. DeepSeek-V4 was here
# until 2026-11-28 (its layer-0 compressor reached the loss only on rows of 128 tokens: model/length_dependent.py),
# then Gemma 3n text (DDP LoRA) and Qwen4-Exp (ZeRO-3), fixed the same day; Moshi's full cells on 2026-11-30 (its
# packed rows took the sliding window its config states and its class never applies: model/attention.py).
FAILING: dict[str, dict[str, str]] = {}


def registry_engines():
    spec = importlib.util.spec_from_file_location("registry_engines", REPO / "scripts" / "registry_engines.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("registry_engines", module)
    spec.loader.exec_module(module)
    return module


def families() -> list:
    return [pytest.param(family, marks=() if family in SLICE else pytest.mark.matrix) for family in decoder_families()]


@pytest.fixture(scope="module")
def matrix(request, tmp_path_factory) -> dict[str, dict]:
    """The families of this session's selected tests, trained together (one launch for all of them)."""
    chosen = [item.callspec.params["family"] for item in request.session.items
              if getattr(item, "originalname", None) == TEST and hasattr(item, "callspec")]
    result = registry_engines().run_matrix(chosen, tmp_path_factory.mktemp("registry-engines"))
    return {record["family"]: record for record in result["families"]}


def test_the_tables_name_registry_families():
    assert set(SLICE) | set(NOT_BUILT) | set(REFUSED) | set(FAILING) <= set(decoder_families())
    assert not set(NOT_BUILT) & set(REFUSED) and not set(REFUSED) & set(FAILING)


@pytest.mark.parametrize("family", families())
def test_registry_family_trains_on_every_engine(family, matrix):
    record = matrix[family]
    if family in NOT_BUILT:
        assert NOT_BUILT[family] in record["build"], f"{family} builds now: take it off NOT_BUILT"
        return
    assert record["build"] == "ok", record["build"]
    unexpected = {cell: {"found": outcome, "listed": listed_outcome(family, cell) or "ok"}
                  for cell, outcome in record["cells"].items() if not as_listed(outcome, listed_outcome(family, cell))}
    assert not unexpected, f"{family}: {unexpected}"


def listed_outcome(family: str, cell: str) -> tuple[str, str] | None:
    """What the tables expect of a cell: (kind, a part of the reason); None for a pass."""
    if reason := FAILING.get(family, {}).get(cell):
        return "failed", reason
    return ("refused", REFUSED[family]) if family in REFUSED else None


def as_listed(outcome: str, listed: tuple[str, str] | None) -> bool:
    if listed is None:
        return outcome == "ok"
    kind, reason = listed
    return outcome.startswith(kind) and reason in outcome


def test_a_cell_past_the_bound_fails_and_its_launch_is_stopped(arch_model_dir, tmp_path):
    """The first step of a cell cannot finish within half a second of its start: the cell fails with that reason
    and its launch is stopped, the ranks included (torchrun starts them in sessions of their own)."""
    import psutil

    module = registry_engines()
    cell = module.plan_cell("llama/ddp-lora", arch_model_dir("llama"), tmp_path / "run", 2, (), "lora")
    ends = module.run_cells([cell], 2, tmp_path / "launches", bound=0.5)
    assert ends["llama/ddp-lora"]["error"] == "first step not finished within 0.5 s"
    assert module.status_lines(tmp_path / "launches" / "launch-2-1")  # the cell had started
    left = [proc.pid for proc in psutil.process_iter(["cmdline"])
            if str(tmp_path / "launches") in " ".join(proc.info["cmdline"] or [])]
    assert not left
