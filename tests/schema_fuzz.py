"""Inputs for the schema-driven fuzzer (tests/unit/test_fuzz_schema.py), generated from config/schema.py.

Every declared key gets the mistakes users make with a key of its type: the wrong type, values past and on its
bounds, other units, near-miss spellings of its choices, lists separated by spaces or semicolons, and, for keys
that name files, a path that is missing, a folder where a file is expected (and the reverse), an empty file, a
symbolic-link loop, a file of another format and a URL. Every key name gets a typo. Pairs of features are drawn
across stages and engines. A case says which keys the refusal must name and whether it must be refused.

Deterministic for a seed: the same cases every run (make test must not fail one run in ten); a case's id
reproduces it (`pytest 'tests/unit/test_fuzz_schema.py::test_check_contract[<id>]'`).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

from shardtune.config.schema import config_fields

# Placeholders the runner turns into real paths in the case's own folder.
MISSING, FOLDER, FILE, EMPTY, LOOP, OTHER_FORMAT, URL = ("@missing", "@folder", "@file", "@empty", "@loop",
                                                         "@png", "https://example.com/models/x")
PATH_VALUES = (MISSING, FOLDER, FILE, EMPTY, LOOP, OTHER_FORMAT, URL)
# Keys whose own mutations the base runs cannot judge: the launch plan comes from them (they are tried through
# the pairs instead), or they only say where to write.
NOT_MUTATED = frozenset({"model_name_or_path", "dataset_dir", "output_dir"})


@dataclass(frozen=True)
class Case:
    id: str
    values: dict[str, Any]  # set on top of the base config
    culprits: tuple[str, ...]  # a refusal must name one of these
    must_refuse: bool = False
    removed: tuple[str, ...] = field(default=())
    names_all: bool = False  # one refusal line must name every culprit (a pair that cannot run together)


def type_names(annotation: str) -> set[str]:
    return {part.strip() for part in annotation.replace("list[str]", "list").split("|")}


def typo(word: str, rng: random.Random) -> str:
    """One edit a hand makes: two neighbours swapped, a letter dropped, doubled or another put in its place."""
    if len(word) < 3:
        return word + "x"
    i = rng.randrange(len(word) - 1)
    kind = rng.randrange(4)
    if kind == 0 and word[i] != word[i + 1]:
        return word[:i] + word[i + 1] + word[i] + word[i + 2:]
    if kind == 1:
        return word[:i] + word[i + 1:]
    if kind == 2:
        return word[:i] + word[i] + word[i:]
    return word[:i] + ("q" if word[i] != "q" else "z") + word[i + 1:]


def numeric_cases(f: dataclasses.Field, kinds: set[str]) -> list[tuple[str, Any, bool]]:
    """(label, value, must_refuse) for an int or float key."""
    is_int = "int" in kinds and "float" not in kinds
    low, high = f.metadata["minimum"], f.metadata["maximum"]
    cases: list[tuple[str, Any, bool]] = [("text", "abc", True), ("list", [1], True), ("mapping", {"a": 1}, True),
                                          ("percent", "10%", True), ("unit", "5GB", True)]
    if is_int:
        cases += [("fraction", 1.5, True), ("bool", True, True), ("huge", 2**70, False)]
    else:
        cases += [("nan", "nan", False), ("inf", float("inf"), False), ("exponent_text", "1e-4", False)]
    if low is not None:
        below = low - 1 if is_int else low - abs(low) * 0.5 - 0.5
        cases += [("below_minimum", below, True), ("minimum", low, bool(f.metadata["exclusive_minimum"]))]
    if high is not None:
        above = high + 1 if is_int else high * 1.5 + 0.5
        cases += [("above_maximum", above, True), ("maximum", high, False)]
    if low is None and high is None:
        cases += [("negative", -1, False), ("zero", 0, False)]
    return cases


def choice_cases(choices: tuple[Any, ...], rng: random.Random) -> list[tuple[str, Any, bool]]:
    named = [c for c in choices if isinstance(c, str)]
    if not named:
        return []
    pick = rng.choice(named)
    near = typo(pick, rng)
    lowered = {c.lower() for c in named}
    return [("choice_typo", near, near.lower() not in lowered), ("choice_upper", pick.upper(), False),
            ("choice_padded", f" {pick} ", False), ("choice_unknown", pick + "_v2", True),
            ("choice_list", f"{pick},{pick}", False), ("choice_number", 7, False)]


def key_cases(f: dataclasses.Field, rng: random.Random) -> list[tuple[str, Any, bool]]:
    kinds = type_names(str(f.type))
    cases: list[tuple[str, Any, bool]] = []
    if kinds & {"int", "float"}:
        cases += numeric_cases(f, kinds)
    if "bool" in kinds and not kinds & {"str", "int", "float"}:
        cases += [("bool_text", "maybe", True), ("bool_number", 2, True), ("bool_list", [True], True)]
    if f.metadata["choices"]:
        cases += choice_cases(f.metadata["choices"], rng)
    elif "str" in kinds:
        cases += [("empty", "", False), ("blank", "  ", False), ("number", 12, False), ("mapping", {"a": 1}, False),
                  ("nul", "a\x00b", False), ("long", "x" * 5000, False)]
    if "list" in kinds:
        cases += [("space_separated", "demo demo_sharegpt", False), ("semicolon_separated", "demo;demo_sharegpt",
                                                                                            False),
                  ("numbers", [1, 2], False), ("empty_item", "demo,,", False)]
    if "dict" in kinds:
        cases += [("dict_text", "not a mapping", False), ("dict_list", [1, 2], False)]
    if f.metadata["path"]:
        cases += [(f"path_{p.strip('@').split(':')[0]}", p, False) for p in PATH_VALUES]
    return cases


def config_cases(seed: int) -> list[Case]:
    """One case per key and mistake, and a typo of every key's name."""
    rng = random.Random(seed)
    cases = []
    for f in config_fields():
        if f.name in NOT_MUTATED:
            continue
        for label, value, must_refuse in key_cases(f, rng):
            cases.append(Case(f"{f.name}-{label}", {f.name: value}, (f.name,), must_refuse))
        misspelt = typo(f.name, rng)
        if misspelt != f.name:
            cases.append(Case(f"{f.name}-key_typo", {misspelt: True}, (misspelt,), must_refuse=True))
    return cases


def mapped_key_cases() -> list[Case]:
    """Every key another project spells (config/compat.py MAPPED: LLaMA-Factory, the Trainer, torchtitan, axolotl)
    with values of the wrong kind: it is translated or refused in a line naming it or what it becomes."""
    from shardtune.config.compat import MAPPED

    known = {f.name for f in config_fields()}
    cases = []
    for key, mapped in sorted(MAPPED.items()):
        targets = tuple(word.strip("(),:;'`") for word in mapped.becomes.split())
        culprits = (key, *[t for t in targets if t in known])
        for label, value in (("word", "sometimes"), ("number", 7), ("list", [1, "x"]), ("mapping", {"a": 1})):
            cases.append(Case(f"mapped-{key}-{label}", {key: value}, culprits))
    return cases


# Features a run switches on, each with the value that switches it on.
FEATURES: dict[str, Any] = {
    "packing": True, "neat_packing": True, "sequence_parallel_size": 2, "mixture_of_depths": "convert",
    "torch_compile": True, "neftune_noise_alpha": 5.0, "use_dora": True, "pissa_init": True, "use_rslora": True,
    "loraplus_lr_ratio": 16.0, "use_galore": True, "use_badam": True, "use_apollo": True, "use_llama_pro": True,
    "streaming": True, "gradient_checkpointing": True, "bf16": True, "fp16": True, "fp8": True,
    "quantization_bit": 4, "enable_liger_kernel": True, "use_unsloth": True, "shift_attn": True,
    "train_on_prompt": True, "mask_history": True, "padding_free": True, "attn_implementation": "varlen",
    "finetuning_type": "freeze", "do_predict": True, "val_size": 0.1, "report_to": "tensorboard",
    "optim": "sgd", "resize_vocab": True, "flash_attn": "fa2", "use_adam_mini": True, "async_save": True,
    "save_only_model": True, "expert_parallel_size": 2,
}
STAGES = ("pt", "dpo", "kto", "rm")
ENGINES: dict[str, dict[str, Any]] = {"zero3": {"deepspeed": "z3"}, "zero2_offload": {"deepspeed": "z2_offload"},
                                      "fsdp": {"fsdp": "full_shard auto_wrap"}, "ddp": {}}


def pair_cases(seed: int, count: int) -> list[Case]:
    """Two features, a feature under a stage, or a feature under an engine: ``count`` drawn from all of them."""
    rng = random.Random(seed)
    known = {f.name for f in config_fields()}
    features = {k: v for k, v in FEATURES.items() if k in known or k in ("flash_attn",)}
    names = sorted(features)
    pool: list[Case] = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pool.append(Case(f"pair-{a}-{b}", {a: features[a], b: features[b]}, (a, b)))
        for stage in STAGES:
            pool.append(Case(f"stage_{stage}-{a}", {"stage": stage, a: features[a]}, ("stage", a)))
        for engine, values in ENGINES.items():
            pool.append(Case(f"engine_{engine}-{a}", {**values, a: features[a]}, (*values, a)))
    rng.shuffle(pool)
    return sorted(pool[:count], key=lambda c: c.id)


def sequence_parallel_refusal_cases(size: int = 2) -> list[Case]:
    """Every feature engines/sequence_parallel_plan.py's COMBINATIONS refuses, switched on beside
    ``sequence_parallel_size``: check must refuse it in a line naming both keys (run with a world the split fits)."""
    from shardtune.engines.sequence_parallel_plan import COMBINATIONS, REFUSED

    return [Case(f"sequence_parallel-{row.key}", {"sequence_parallel_size": size,
                                                  row.key: row.value if row.value is not None else FEATURES[row.key]},
                 ("sequence_parallel_size", row.key), must_refuse=True, names_all=True)
            for row in COMBINATIONS if row.kind == REFUSED]
