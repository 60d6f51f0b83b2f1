"""Messages that name the right thing (issue 42, point 7): a URL where a path is expected, a file where a folder
is expected (and the reverse), a command typo, and a dataset whose records are another format's, each said in one
line that names the key and what to give instead."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import yaml

from shardtune.cli import main
from tests.conftest import REPO


def run(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    return code, err.getvalue()


@pytest.fixture
def config(tiny_model_dir, tmp_path) -> Path:
    """A config that passes check: the tiny model on the bundled demo data."""
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({
        "model_name_or_path": str(tiny_model_dir), "dataset": "demo", "dataset_dir": str(REPO / "data"),
        "template": "chatml", "finetuning_type": "lora", "output_dir": str(tmp_path / "out")}))
    return path


def test_base_config_passes(config):
    assert run("check", str(config)) == (0, "")


URLS = {"model_name_or_path": "https://huggingface.co/org/model", "adapter_name_or_path": "hf://org/adapter",
        "dataset_dir": "s3://bucket/data", "output_dir": "s3://bucket/out", "logging_dir": "gs://bucket/tb",
        "resume_from_checkpoint": "https://example.com/checkpoint-10", "tokenized_path": "s3://bucket/tok",
        "deepspeed": "https://example.com/ds_z3.json", "fsdp_config": "https://example.com/fsdp.yaml",
        "ray_storage_path": "s3://bucket/ray", "ref_model": "hf://org/ref"}


@pytest.mark.parametrize("key", sorted(URLS))
def test_url_for_a_path_key_is_named_as_a_url(config, key):
    code, err = run("check", str(config), f"{key}={URLS[key]}")
    assert code == 2
    assert f"{key}: '{URLS[key]}' is a URL; shardtune reads local paths: download it first" in err, err
    assert "not found" not in err and "does not exist" not in err, err


def test_url_of_a_model_page_tells_its_hub_id(config):
    code, err = run("check", str(config), "model_name_or_path=https://huggingface.co/org/model")
    assert code == 2
    assert "or give its hub id 'org/model'" in err, err


def test_hub_id_is_still_a_model_name(config):
    from shardtune.config.load import build_config

    assert build_config({"model_name_or_path": "org/model"}).model_name_or_path == "org/model"


def test_url_as_a_data_file_is_named_as_a_url(config, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset_info.json").write_text(json.dumps({"web": {"file_name": "https://example.com/d.jsonl"}}))
    code, err = run("check", str(config), f"dataset_dir={data}", "dataset=web")
    assert code == 2
    assert "file_name 'https://example.com/d.jsonl' is a URL; shardtune reads local paths: download it first" in err


def a_file(folder: Path) -> Path:
    path = folder / "notes.txt"
    path.write_text("text\n")
    return path


@pytest.mark.parametrize("key, says", [
    ("adapter_name_or_path", "is a file; give the adapter folder"),
    ("dataset_dir", "is a file; give the folder holding dataset_info.json"),
    ("output_dir", "is a file; give a folder"),
    ("logging_dir", "is a file; give a folder"),
    ("ray_storage_path", "is a file; give a folder"),
])
def test_file_where_a_folder_is_expected(config, tmp_path, key, says):
    path = a_file(tmp_path)
    code, err = run("check", str(config), f"{key}={path}")
    assert code == 2
    assert f"{key}: {path} {says}" in err, err


def test_dataset_info_itself_for_dataset_dir(config):
    info = REPO / "data" / "dataset_info.json"
    code, err = run("check", str(config), f"dataset_dir={info}")
    assert code == 2
    assert f"dataset_dir: {info} is a file; give the folder holding dataset_info.json ({info.parent})" in err, err


def test_missing_adapter_folder_is_not_found(config, tmp_path):
    code, err = run("check", str(config), f"adapter_name_or_path={tmp_path / 'gone'}")
    assert code == 2
    assert f"adapter_name_or_path: folder not found: {tmp_path / 'gone'}" in err, err


@pytest.fixture
def dpo_config(config) -> list[str]:
    return ["check", str(config), "stage=dpo", "dataset=demo_dpo"]


def test_file_for_ref_model_adapters(dpo_config, tmp_path, tiny_model_dir):
    path = a_file(tmp_path)
    code, err = run(*dpo_config, f"ref_model={tiny_model_dir}", f"ref_model_adapters={path}")
    assert code == 2
    assert f"ref_model_adapters: {path} is a file; give the adapter folder" in err, err


def test_file_for_ref_model(dpo_config, tmp_path):
    path = a_file(tmp_path)
    code, err = run(*dpo_config, f"ref_model={path}")
    assert code == 2
    assert f"ref_model: {path} is a file; give the model folder" in err, err


def test_command_typo_is_one_line_with_did_you_mean():
    code, err = run("trian", "cfg.yaml")
    assert code == 2
    assert err == ("shardtune: error: unknown command 'trian' (did you mean 'train'?); `shardtune --help` lists the "
                   "commands\n")


def test_unknown_command_without_a_close_one():
    code, err = run("frobnicate")
    assert code == 2
    assert err == "shardtune: error: unknown command 'frobnicate'; `shardtune --help` lists the commands\n"


def test_config_file_without_a_command():
    code, err = run("cfg.yaml", "lora_rank=8")
    assert code == 2
    assert err == ("shardtune: error: unknown command 'cfg.yaml' (a config file: did you mean `shardtune train "
                   "cfg.yaml` or `shardtune check cfg.yaml`?); `shardtune --help` lists the commands\n")


def test_key_typo_as_a_flag_says_did_you_mean(config):
    code, err = run("train", str(config), "--lerning_rate", "1")
    assert code == 2
    assert "unknown key 'lerning_rate' (did you mean 'learning_rate'?)" in err


OPENAI = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
SHAREGPT = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
SHAREGPT_OPENAI_ROLES = {"conversations": [{"from": "user", "value": "hi"}, {"from": "assistant", "value": "yo"}]}
ALPACA = {"instruction": "hi", "input": "", "output": "hello"}
OPENAI_TAGS = ('"tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", '
               '"assistant_tag": "assistant"}')
SHAREGPT_TAGS = '"tags": {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt"}'


@pytest.mark.parametrize("entry, record, says", [
    ({"formatting": "sharegpt"}, OPENAI, '"formatting": "openai"'),
    ({"formatting": "openai"}, SHAREGPT, '"formatting": "sharegpt"'),
    ({"formatting": "sharegpt"}, ALPACA, '"formatting": "alpaca"'),
    ({}, SHAREGPT, '"formatting": "sharegpt"'),
    ({"formatting": "sharegpt", "columns": {"messages": "messages"}}, OPENAI, OPENAI_TAGS),
    ({"formatting": "openai", "columns": {"messages": "conversations"}}, SHAREGPT, SHAREGPT_TAGS),
    ({"formatting": "sharegpt"}, SHAREGPT_OPENAI_ROLES, '"tags": {"user_tag": "user", "assistant_tag": "assistant"}'),
], ids=["sharegpt-entry-openai-records", "openai-entry-sharegpt-records", "sharegpt-entry-alpaca-records",
        "alpaca-entry-sharegpt-records", "sharegpt-tags-openai-turns", "openai-tags-sharegpt-turns",
        "sharegpt-openai-roles"])
def test_records_of_another_format_name_the_keys_to_set(config, tmp_path, entry, record, says):
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "mine.jsonl", **entry}}))
    (data / "mine.jsonl").write_text(json.dumps(record) + "\n")
    code, err = run("check", str(config), f"dataset_dir={data}", "dataset=mine")
    assert code == 2
    assert says in err and "dataset 'mine'" in err, err
    assert len(err.splitlines()) == 1, err


def test_records_of_another_format_in_a_json_array(config, tmp_path):
    """LLaMA-Factory's demo files are JSON arrays: their first record is read too."""
    data = tmp_path / "data"
    data.mkdir()
    entry = {"file_name": "mine.json", "formatting": "sharegpt", "columns": {"messages": "messages"}}
    (data / "dataset_info.json").write_text(json.dumps({"mine": entry}))
    (data / "mine.json").write_text(json.dumps([OPENAI, OPENAI], indent=2))
    code, err = run("check", str(config), f"dataset_dir={data}", "dataset=mine")
    assert code == 2
    assert OPENAI_TAGS in err, err


@pytest.mark.parametrize("formatting, record, says", [
    ("sharegpt", OPENAI["messages"], OPENAI_TAGS),
    ("openai", SHAREGPT["conversations"], SHAREGPT_TAGS),
    ("sharegpt", SHAREGPT_OPENAI_ROLES["conversations"], '"tags": {"user_tag": "user", "assistant_tag": "assistant"}'),
])
def test_training_says_the_same_for_every_record(formatting, record, says):
    from shardtune.data.formats import RecordError, openai_to_chat, sharegpt_to_chat
    from shardtune.data.registry import DEFAULT_COLUMNS, DEFAULT_TAGS

    convert = sharegpt_to_chat if formatting == "sharegpt" else openai_to_chat
    columns = {**DEFAULT_COLUMNS[formatting], "messages": "turns"}
    with pytest.raises(RecordError) as raised:
        convert({"turns": record}, columns, DEFAULT_TAGS[formatting])
    assert says in str(raised.value)


SALLOC = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2"}


@pytest.mark.parametrize("argv", [["check"], ["estimate", "--gpu-memory", "80GiB"], ["train", "--dry-run"]],
                         ids=lambda argv: argv[0])
@pytest.mark.parametrize("node", [{}, {"SLURMD_NODENAME": "n1"}], ids=["login-host", "batch-script"])
def test_slurm_remedy_names_no_other_command(config, monkeypatch, argv, node):
    """Inside an allocation but outside srun, every command is told to run under srun, not to run `train`."""
    for name, value in {**SALLOC, **node}.items():
        monkeypatch.setenv(name, value)
    for name in ("SLURM_STEP_ID", "SLURMD_NODENAME", "RANK", "LOCAL_RANK"):
        if name not in node:
            monkeypatch.delenv(name, raising=False)
    code, err = run(argv[0], str(config), *argv[1:])
    assert code == 2
    assert "put `srun --ntasks-per-node=1` in front of this shardtune command" in err, err
    assert "shardtune train" not in err, err


def test_export_of_a_missing_yaml_names_the_file(tmp_path):
    """`export FILE.yaml` with a FILE that is not there: the file is named, not --out (which a file does not need)."""
    code, err = run("export", str(tmp_path / "merge.yaml"))
    assert code == 2
    assert err == f"shardtune: error: export: config file not found: {tmp_path / 'merge.yaml'}\n", err


@pytest.mark.parametrize("command, says", [
    ("eval", "eval: {path} is a file; give the trained model folder first (a run's output_dir or an exported model)"),
    ("export", "export: {path} is a file; give a checkpoint-<step> folder, a run's output_dir or an adapter folder"),
    ("chat", "chat: {path} is a file; give a model folder (a run's output_dir, an adapter, a checkpoint) or its "
             "YAML file"),
])
def test_file_where_a_subcommand_wants_a_folder(tmp_path, command, says):
    path = a_file(tmp_path)
    code, err = run(command, str(path), *(["--out", str(tmp_path / "x")] if command == "export" else []))
    assert code == 2
    assert says.format(path=path) in err, err


def test_eval_with_the_config_first_says_the_order(config, tiny_model_dir):
    code, err = run("eval", str(config), str(tiny_model_dir))
    assert code == 2
    assert f"eval: {config} is a config file; give the trained model folder first: shardtune eval OUTPUT" in err, err


@pytest.mark.parametrize("command", ["eval", "chat"])
def test_missing_folder_for_a_subcommand_is_not_found(tmp_path, command):
    code, err = run(command, str(tmp_path / "gone"))
    assert code == 2
    assert f"{command}: folder not found: {tmp_path / 'gone'}" in err, err


def test_status_of_a_file_says_it_is_a_file(tmp_path):
    path = a_file(tmp_path)
    code, err = run("status", str(path))
    assert code == 2
    assert f"status: {path} is a file; give a run's output_dir (or a folder of runs)" in err, err
    code, err = run("status", str(tmp_path / "gone"))
    assert f"status: folder not found: {tmp_path / 'gone'}" in err, err


@pytest.mark.parametrize("argv", [["export", "s3://bucket/run", "--out", "x"], ["eval", "https://example.com/run"],
                                  ["chat", "hf://org/model"], ["status", "s3://bucket/run"]], ids=lambda a: a[0])
def test_url_for_a_subcommand_folder_is_named_as_a_url(argv):
    code, err = run(*argv)
    assert code == 2
    assert f"{argv[0]}: '{argv[1]}' is a URL; shardtune reads local paths: download it first" in err, err


def merge_file(tmp_path: Path, model: Path, export_dir: str) -> Path:
    path = tmp_path / "merge.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": str(model), "template": "chatml",
                                    "export_dir": export_dir}))
    return path


def test_export_dir_url_is_refused_not_written_as_a_folder(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = run("export", str(merge_file(tmp_path, tiny_model_dir, "s3://bucket/merged")))
    assert code == 2
    assert "export_dir: 's3://bucket/merged' is a URL; shardtune reads local paths" in err, err
    assert not (tmp_path / "s3:").exists()


def test_export_dir_file_names_export_dir_not_out(tmp_path, tiny_model_dir):
    path = a_file(tmp_path)
    code, err = run("export", str(merge_file(tmp_path, tiny_model_dir, str(path))))
    assert code == 2
    assert f"export: export_dir {path} is a file; choose a folder" in err, err


@pytest.mark.parametrize("argv, says", [
    (["export", "run", "--outt", "y"], "unrecognized arguments: --outt y (did you mean '--out'?;"),
    (["status", "run", "--wach", "2"], "unrecognized arguments: --wach 2 (did you mean '--watch'?;"),
])
def test_option_typo_of_a_subcommand_says_did_you_mean(argv, says, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


def test_option_typo_message(capsys):
    from shardtune.arguments import CommandParser

    parser = CommandParser(prog="shardtune export")
    parser.add_argument("--out")
    parser.add_argument("--merge-lora", action="store_true")
    with pytest.raises(SystemExit):
        parser.parse_args(["--merge-lroa", "--out", "x"])
    assert capsys.readouterr().err == ("shardtune export: error: unrecognized arguments: --merge-lroa (did you mean "
                                       "'--merge-lora'?; `shardtune export --help` lists the options)\n")


def test_estimate_flag_typo_says_did_you_mean(config, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["estimate", str(config), "--gpu-memry", "80GiB"])
    assert exited.value.code == 2
    assert capsys.readouterr().err == ("shardtune estimate: error: unrecognized arguments: --gpu-memry 80GiB (did you "
                                       "mean '--gpu-memory'?; `shardtune estimate --help` lists the options)\n")


OPENAI_PAIR = {"messages": [{"role": "user", "content": "hi"}], "chosen": {"role": "assistant", "content": "hello"},
               "rejected": {"role": "assistant", "content": "no"}}


@pytest.mark.parametrize("columns, says", [
    ({"chosen": "chosen", "rejected": "rejected"}, '"formatting": "openai"'),
    ({"messages": "messages", "chosen": "chosen", "rejected": "rejected"}, OPENAI_TAGS),
], ids=["columns", "tags"])
def test_preference_records_of_another_format_name_the_keys(config, tmp_path, columns, says):
    data = tmp_path / "data"
    data.mkdir()
    entry = {"file_name": "pairs.jsonl", "formatting": "sharegpt", "ranking": True, "columns": columns}
    (data / "dataset_info.json").write_text(json.dumps({"pairs": entry}))
    (data / "pairs.jsonl").write_text(json.dumps(OPENAI_PAIR) + "\n")
    code, err = run("check", str(config), f"dataset_dir={data}", "dataset=pairs", "stage=dpo")
    assert code == 2
    assert says in err and len(err.splitlines()) == 1, err
