"""``shardtune chat``: talk to a trained model in one process with transformers' ``generate``.

The model is a run's output (full model or LoRA adapter on its base), a ``checkpoint-<step>`` folder of any engine,
an exported folder, or a LLaMA-Factory inference file (``model_name_or_path``, ``adapter_name_or_path``,
``template``, ``infer_backend: huggingface``, generation keys). Prompts are rendered with the template the run
trained with (the run's config, else ``template``, else the tokenizer's own chat template) and encoded piece by
piece as training encoded them; answers stream as they are generated and stop at the template's stop token.
Interactive by default (``clear`` forgets the conversation, ``exit`` or end of input quits); ``--prompt`` and
``--file`` answer and exit.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from shardtune import run_files
from shardtune.arguments import CommandParser
from shardtune.config.args import parse_subcommand
from shardtune.config.schema import TrainConfig
from shardtune.errors import ConfigError
from shardtune.paths import folder_problem

# What a chat takes from the run that trained the model (its resolved config).
RUN_KEYS = ("template", "default_system", "enable_thinking", "tool_format", "trust_remote_code")
# The config keys a chat reads (`shardtune chat --help` lists them): the model, its template, how to generate.
CHAT_KEYS = (*RUN_KEYS, "model_name_or_path", "adapter_name_or_path", "infer_dtype", "do_sample", "temperature",
             "top_p", "top_k", "num_beams", "max_new_tokens", "repetition_penalty", "length_penalty",
             "skip_special_tokens")
Message = dict[str, str]


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="shardtune chat", description="Talk to a trained model: a run's output, an adapter, a checkpoint-<step> "
                                           "folder, an exported folder, or a LLaMA-Factory inference YAML. Config "
                                           "keys as key=value or --key value (temperature=0.3 --max_new_tokens 256).")
    parser.add_argument("model", help="model folder or YAML file")
    parser.add_argument("--prompt", help="answer this one message and exit")
    parser.add_argument("--file", help="answer each non-empty line of this file (each on its own) and exit")
    parser.add_argument("--system", help="system prompt (default: the template's)")
    parser.add_argument("--model", dest="base", help="base model of an adapter or checkpoint (default: the run's)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def chat_command(args: list[str]) -> int:
    ns, settings = parse_subcommand(build_parser(), args, CHAT_KEYS)
    session = open_session(ns.model, settings, ns.base)
    if ns.prompt is not None:
        session.answer([], ns.prompt, ns.system, sys.stdout)
        return 0
    if ns.file is not None:
        for line in Path(ns.file).read_text(encoding="utf-8").splitlines():
            if line.strip():
                session.answer([], line, ns.system, sys.stdout)
        return 0
    converse(session, ns.system, sys.stdin, sys.stdout)
    return 0


@dataclass
class ChatSession:
    """A loaded model, its tokenizer and template, and how to generate."""

    model: Any
    tokenizer: Any
    template: Any
    config: TrainConfig

    def prompt_ids(self, history: list[Message], text: str, system: str | None) -> list[int]:
        """The conversation and the new message, encoded as training encoded the prompt of a turn."""
        messages = [*history, {"role": "user", "content": text}, {"role": "assistant", "content": ""}]
        turns = self.template.render_turns(system or "", messages, self.tokenizer)
        pieces = [piece for turn in turns[:-1] for piece in turn] + [turns[-1][0]]
        return [t for piece in self.tokenizer(pieces, add_special_tokens=False)["input_ids"] for t in piece]

    def answer(self, history: list[Message], text: str, system: str | None, out: Any) -> str:
        """Generate the answer to ``text`` after ``history``, streaming it to ``out``; returns it."""
        import torch

        from shardtune.infer.generation import answer_ids, generation_settings, stop_token_ids

        stops = stop_token_ids(self.tokenizer, self.template.stop_token(self.tokenizer))
        settings = generation_settings(self.config)
        ids = torch.tensor([self.prompt_ids(history, text, system)], device=self.model.device)
        streamer = text_streamer(self.tokenizer, out, settings.skip_special_tokens)
        with torch.no_grad():
            generated = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), streamer=streamer,
                                            **settings.generate_kwargs(stops, self.tokenizer.pad_token_id))
        new = answer_ids(generated[0, ids.shape[1]:].tolist(), stops)
        return self.tokenizer.decode(new, skip_special_tokens=True)


def text_streamer(tokenizer: Any, out: Any, skip_special_tokens: bool) -> Any:
    """transformers' streamer writing each finished piece of text to ``out`` (not print's stdout)."""
    from transformers import TextStreamer

    class StreamTo(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            out.write(text + ("\n" if stream_end else ""))
            out.flush()

    return StreamTo(tokenizer, skip_prompt=True, skip_special_tokens=skip_special_tokens)


def converse(session: ChatSession, system: str | None, lines: TextIO, out: TextIO) -> None:
    """The interactive loop: ``User:`` prompts, streamed ``Assistant:`` answers, history kept until ``clear``."""
    history: list[Message] = []
    out.write("Chat with the model: 'clear' forgets the conversation, 'exit' quits.\n")
    while True:
        out.write("\nUser: ")
        out.flush()
        line = lines.readline()
        if not line or line.strip() in ("exit", "quit"):
            out.write("\n" if not line else "")
            return
        text = line.rstrip("\n")
        if text.strip() == "clear":
            history = []
            out.write("History cleared.\n")
            continue
        if not text.strip():
            continue
        out.write("Assistant: ")
        reply = session.answer(history, text, system, out)
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]


def open_session(given: str, overrides: list[str], base: str | None) -> ChatSession:
    """Load what ``given`` names (a folder, or a LLaMA-Factory inference YAML) with the settings to chat."""
    from shardtune.config.args import read_config

    target = Path(given)
    is_file = target.suffix in (".yaml", ".yml", ".json") and target.is_file()
    if not is_file and not target.is_dir():
        raise ConfigError(target_problem(given))
    run = {} if is_file else run_defaults(target)
    config, cmd, problems = read_config([str(target), *overrides] if is_file else overrides, run)
    if problems:
        raise ConfigError(*(p.text for p in problems))
    given_template = "template" in run or "template" in cmd.values or (is_file and _file_sets_template(target))
    model, tokenizer = load_chat_model(target, config, base, is_file)
    return ChatSession(model, tokenizer, chat_template(config, tokenizer, given_template), config)


def target_problem(target: str) -> str:
    """Why ``target`` is neither a model folder nor a YAML file: missing (a file or a folder, by its name) or a
    file of another kind."""
    if Path(target).suffix in (".yaml", ".yml", ".json") and not Path(target).exists():
        return f"chat: config file not found: {target}"
    return folder_problem("chat", target, "a model folder (a run's output_dir, an adapter, a checkpoint) or its YAML "
                                          "file") or ""


def _file_sets_template(path: Path) -> bool:
    from shardtune.config.load import load_yaml_file

    return "template" in load_yaml_file(path)


def run_defaults(folder: Path) -> dict[str, Any]:
    """The template keys of the run that wrote ``folder`` (a checkpoint's run config is in its parent)."""
    import json

    for place in (folder, folder.parent):
        path = place / run_files.RESOLVED_CONFIG
        if path.is_file():
            run = json.loads(path.read_text())
            return {key: run[key] for key in RUN_KEYS if run.get(key) is not None}
    return {}


def chat_template(config: TrainConfig, tokenizer: Any, given: bool) -> Any:
    """The run's (or the given) template; without one, the tokenizer's own chat template when it has one."""
    from shardtune.data.templates import get_template

    name = config.template if given or not getattr(tokenizer, "chat_template", None) else "auto"
    template = get_template(name, config.default_system, config.enable_thinking, config.tool_format)
    template.validate(tokenizer)
    return template


def load_chat_model(target: Path, config: TrainConfig, base: str | None, is_file: bool) -> tuple[Any, Any]:
    """The model in its inference dtype on the GPU when there is one, and its tokenizer."""
    import torch

    from shardtune.export.convert import load_trained, resolve_trained
    from shardtune.export.serving import checkpoint_dtype
    from shardtune.model.load import load_tokenizer

    merged_first: tuple[str, ...] = ()
    if is_file:
        if config.model_name_or_path is None:
            raise ConfigError(f"{target}: model_name_or_path is required")
        adapters = list(config.adapter_name_or_path)
        source = Path(adapters[-1] if adapters else config.model_name_or_path)
        trained = resolve_trained(source, config.model_name_or_path if adapters else None,
                                  "lora" if adapters else None)
        merged_first = tuple(adapters[:-1])
    else:
        trained = resolve_trained(target, base)
    model, tokenizer_from = load_trained(trained, merged_first)
    dtype = config.infer_dtype if config.infer_dtype != "auto" else checkpoint_dtype(
        str(trained.source) if trained.kind == "model" else trained.base)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device=device, dtype=getattr(torch, dtype)).eval()
    return model, load_tokenizer(tokenizer_from, trust_remote_code=config.trust_remote_code)
