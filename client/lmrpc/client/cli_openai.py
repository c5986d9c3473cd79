"""`lmrpc complete` and `lmrpc chat`: the OpenAIService from the command line.

`lmrpc chat "question"` streams one answer; `lmrpc chat` with no question is an interactive session that keeps
the conversation's history (one line per turn; end it with an empty line at EOF, Ctrl-D). Answers go to stdout,
finish reasons and usage to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from typing import Any, TextIO

from lmrpc.client.cli_output import print_json, unescape
from lmrpc.client.client import Client
from lmrpc.client.openai_results import (
    ChatChoice,
    ChatCompletion,
    Completion,
    CompletionChoice,
    CompletionFinishReason,
    CompletionUsage,
    merge_chat,
    merge_completion,
)

EXIT_OK, EXIT_FAILED = 0, 1

# Flags both commands share: (flag, type, metavar, help); dest is the request field.
COMMON_FLAGS: tuple[tuple[str, type, str, str], ...] = (
    ("--max-tokens", int, "N", "maximum tokens to generate (complete: 16; chat: what the context leaves)"),
    ("--temperature", float, "T", "sampling temperature; 0 is greedy"),
    ("--top-p", float, "P", "nucleus sampling probability mass, in (0, 1]"),
    ("--top-k", int, "K", "keep only the k most likely tokens; -1 keeps all"),
    ("--n", int, "N", "choices (default 1)"),
    ("--seed", int, "SEED", "sampling seed for reproducible output"),
    ("--priority", int, "P", "scheduling priority: lower is admitted first among waiting requests (default 0)"),
)


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add `complete` and `chat` to the CLI's subcommands (`sub`: argparse's subparsers action)."""
    comp = sub.add_parser("complete", parents=[common], help="complete prompts (OpenAI completions)",
                          description="Complete one or more prompts through OpenAIService.Complete.")
    comp.add_argument("prompt", nargs="+", help="prompt text; several prompts are sent as one batch")
    _add_common(comp)
    comp.add_argument("--best-of", type=int, metavar="N", help="generate N candidates, return the n best")
    comp.add_argument("--echo", action="store_true", default=None, help="prepend the prompt to the text")
    comp.add_argument("--logprobs", type=int, metavar="K", help="logprobs with K alternatives (printed with --json)")
    comp.add_argument("--suffix", help="text after the completion (needs a model with fill-in-the-middle tokens)")
    comp.set_defaults(command=cmd_complete)

    chat = sub.add_parser("chat", parents=[common], help="ask a question, or chat interactively",
                          description="Chat through OpenAIService.ChatComplete with the model's chat template. With "
                                      "a QUESTION: one answer, streamed. Without: an interactive session that keeps "
                                      "the history (one line per turn; Ctrl-D ends it).")
    chat.add_argument("question", nargs="?", help="the question (omit it for an interactive session)")
    chat.add_argument("--system", metavar="TEXT", help="a system message first")
    _add_common(chat)
    chat.set_defaults(command=cmd_chat)


def _add_common(p: argparse.ArgumentParser) -> None:
    for flag, kind, metavar, help_text in COMMON_FLAGS:
        p.add_argument(flag, type=kind, metavar=metavar, help=help_text)
    p.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable; \\n is a newline)")
    p.add_argument("--model", help="the served model's name (default: the served model)")
    p.add_argument("--params", metavar="JSON",
                   help='more request fields as a JSON object, e.g. \'{"min_p": 0.05}\' (flags win over it)')
    p.add_argument("--stream", action="store_true", help="print text as it is generated (chat always streams)")
    p.add_argument("--json", action="store_true", help="print the response (each chunk with --stream) as JSON")


def _params(args: argparse.Namespace, names: Iterable[str]) -> dict[str, Any]:
    params: dict[str, Any] = json.loads(args.params) if args.params else {}
    if not isinstance(params, dict):
        raise ValueError("--params must be a JSON object")
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            params[name] = value
    if args.stop:
        params["stop"] = [unescape(s) for s in args.stop]
    return params


_COMMON_NAMES = ("max_tokens", "temperature", "top_p", "top_k", "n", "seed", "priority", "model")


def cmd_complete(client: Client, args: argparse.Namespace) -> int:
    params = _params(args, (*_COMMON_NAMES, "best_of", "echo", "logprobs", "suffix"))
    prompt: str | list[str] = args.prompt[0] if len(args.prompt) == 1 else args.prompt
    out = sys.stdout
    if args.stream:
        chunks: list[Completion] = []
        params = {"stream_options": {"include_usage": True}, **params}  # for the summary
        for chunk in client.complete(prompt, stream=True, **params):
            chunks.append(chunk)
            if args.json:
                print_json(chunk, out)
            elif len(args.prompt) * int(params.get("n") or 1) == 1:
                out.write("".join(c.text for c in chunk.choices))
                out.flush()
        completion = merge_completion(chunks)
        if not args.json and len(completion.choices) == 1:
            out.write("\n")
        elif not args.json:
            _print_choices(completion.choices, out)
    else:
        completion = client.complete(prompt, **params)
        if args.json:
            print_json(completion, out)
        elif len(completion.choices) == 1:
            out.write(completion.choices[0].text + "\n")
        else:
            _print_choices(completion.choices, out)
    _summary(completion.choices, completion.usage, sys.stderr)
    return EXIT_OK


def _print_choices(choices: list[CompletionChoice], out: TextIO) -> None:
    for c in choices:
        out.write(f"--- choice {c.index} ---\n{c.text}\n")


def cmd_chat(client: Client, args: argparse.Namespace) -> int:
    params = _params(args, _COMMON_NAMES)
    history: list[dict[str, Any]] = [{"role": "system", "content": args.system}] if args.system else []
    if args.question is not None:
        _turn(client, history, args.question, params, args.json)
        return EXIT_OK
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("you> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:  # EOF
            if interactive:
                print(file=sys.stderr)
            return EXIT_OK
        question = line.rstrip("\n")
        if question.strip():
            _turn(client, history, question, params, args.json)


def _turn(client: Client, history: list[dict[str, Any]], question: str, params: dict[str, Any],
          as_json: bool) -> None:
    """Ask one question with the history so far; stream the answer; add both to the history."""
    history.append({"role": "user", "content": question})
    out = sys.stdout
    chunks: list[ChatCompletion] = []
    params = {"stream_options": {"include_usage": True}, **params}  # for the summary
    for chunk in client.chat(history, stream=True, **params):
        chunks.append(chunk)
        if as_json:
            print_json(chunk, out)
            continue
        for choice in chunk.choices:
            if choice.delta is not None and choice.delta.content and choice.index == 0:
                out.write(choice.delta.content)
                out.flush()
    answer = merge_chat(chunks)
    if not as_json:
        out.write("\n")
        for choice in answer.choices[1:]:
            out.write(f"--- choice {choice.index} ---\n{choice.message.content or ''}\n")
        for choice in answer.choices:
            for call in choice.message.tool_calls:
                out.write(f"[tool call {call.function.name}({call.function.arguments})]\n")
        out.flush()
    if answer.choices:
        history.append(answer.choices[0].message.to_dict())
    _summary(answer.choices, answer.usage, sys.stderr)


def _summary(choices: Iterable[CompletionChoice | ChatChoice], usage: CompletionUsage | None, err: TextIO) -> None:
    listed = list(choices)
    for c in listed:
        line = f"[{c.index}] " if len(listed) > 1 else ""
        reason = c.finish_reason.name.lower() if c.finish_reason is not CompletionFinishReason.UNSPECIFIED else "-"
        line += f"finish: {reason}"
        if c.matched_stop is not None:
            line += f" (matched {c.matched_stop!r})"
        print(line, file=err)
    if usage is not None:
        print(f"usage: prompt {usage.prompt_tokens}, completion {usage.completion_tokens}, cached "
              f"{usage.cached_tokens}", file=err)
