"""The `lmrpc` command line: generate, complete, chat, info, load, tokenize, detokenize, health and abort against an
lmrpc server (complete and chat: cli_openai.py).

Exit codes: 0 success; 1 an RPC failed, an output finished with ERROR, or health is not SERVING; 2 bad usage;
130 interrupted (the call is cancelled, which frees the server's work).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

import grpc

from lmrpc.client import cli_openai
from lmrpc.client.channel import DEFAULT_TARGET, tls
from lmrpc.client.cli_output import file_or_text, print_json, unescape
from lmrpc.client.client import Client
from lmrpc.client.errors import LmrpcError
from lmrpc.client.results import FinishReason, GenerateDelta, GenerateResult, ServingStatus, merge

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command: Callable[[Client, argparse.Namespace], int] = args.command
    try:
        with Client(args.target, credentials=channel_credentials(args), timeout=args.timeout,
                    api_key=args.api_key or None) as client:
            return command(client, args)
    except LmrpcError as e:
        print(f"lmrpc: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except TimeoutError as e:
        print(f"lmrpc: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except (TypeError, ValueError, OSError) as e:  # parameters the client refused to send, an unreadable @FILE
        print(f"lmrpc: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # stdout closed early (e.g. `| head`): stop quietly; leaving the stream cancels the call
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED


# The numeric sampling flags of `lmrpc generate`: (flag, type, metavar, help); dest is the SamplingParams field.
SAMPLING_FLAGS: tuple[tuple[str, type, str, str], ...] = (
    ("--max-new-tokens", int, "N", "maximum tokens to generate (server default 128)"),
    ("--temperature", float, "T", "sampling temperature; 0 is greedy (default: the model's, else 1)"),
    ("--top-p", float, "P", "nucleus sampling probability mass, in (0, 1]"),
    ("--top-k", int, "K", "keep only the k most likely tokens; -1 keeps all"),
    ("--min-p", float, "P", "keep tokens at least P times as likely as the best, in [0, 1]"),
    ("--repetition-penalty", float, "R", "penalty on already generated tokens, in [0, 2]; 1 is off"),
    ("--frequency-penalty", float, "F", "subtracted from a token's logit per occurrence, in [-2, 2]"),
    ("--presence-penalty", float, "P", "subtracted from a token's logit if it occurred, in [-2, 2]"),
    ("--min-new-tokens", int, "N", "forbid stop tokens until N tokens were generated"),
    ("--n", int, "N", "samples per prompt (default 1)"),
)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", metavar="HOST:PORT", default=os.environ.get("LMRPC_TARGET", DEFAULT_TARGET),
                        help="server address host:port (default: $LMRPC_TARGET or %(default)s)")
    common.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="deadline of each call in seconds; a passed deadline aborts the request (default: none)")
    common.add_argument("--api-key", metavar="KEY", default=os.environ.get("LMRPC_API_KEY"),
                        help="API key of a server run with --api-key-file, sent as 'authorization: Bearer KEY' "
                             "(default: $LMRPC_API_KEY)")
    secure = common.add_argument_group("TLS (plaintext unless one of these is given)")
    secure.add_argument("--tls", action="store_true", help="use TLS, trusting the system's root certificates")
    secure.add_argument("--tls-ca", metavar="PEM", help="use TLS, trusting this CA (bundle) for the server certificate")
    secure.add_argument("--tls-cert", metavar="PEM",
                        help="client certificate for mutual TLS (servers run with --tls-client-ca); needs --tls-key")
    secure.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")

    parser = argparse.ArgumentParser(prog="lmrpc", description="Command-line client of the lmrpc generation server.")
    sub = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", parents=[common], help="generate text from one or more prompts",
                         description="Generate text. The text goes to stdout; the finish reason and token usage "
                                     "of each output go to stderr.")
    gen.add_argument("prompt", nargs="+", help="prompt text; several prompts are sent as one batch")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    for flag, kind, metavar, help_text in SAMPLING_FLAGS:
        gen.add_argument(flag, type=kind, metavar=metavar, help=help_text)
    gen.add_argument("--seed", type=int, dest="sampling_seed", metavar="SEED",
                     help="sampling seed for reproducible output")
    gen.add_argument("--stop", action="append", metavar="TEXT",
                     help="stop string (repeatable); escapes like \\n are interpreted")
    gen.add_argument("--stop-token-id", action="append", type=int, dest="stop_token_ids", metavar="ID",
                     help="stop token id (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", default=None, help="keep generating after end-of-sequence")
    constraint = gen.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="SCHEMA",
                            help="constrain the output to this JSON schema (JSON text, or @FILE)")
    constraint.add_argument("--json-object", action="store_true", help="constrain the output to a JSON object")
    constraint.add_argument("--regex", help="constrain the output to match this regular expression")
    constraint.add_argument("--ebnf", metavar="GRAMMAR", help="constrain the output to this EBNF grammar (or @FILE)")
    gen.add_argument("--sampling-params", metavar="JSON",
                     help='more sampling parameters as a JSON object, e.g. \'{"logit_bias": {"5": 2.0}}\' '
                          "(flags win over it)")
    gen.add_argument("--logprobs", action="store_true", help="return output logprobs (printed with --json)")
    gen.add_argument("--top-logprobs", type=int, default=0, metavar="K",
                     help="with --logprobs: K alternatives per token")
    gen.add_argument("--logprob-start-len", type=int, metavar="POS", help="with --logprobs: prompt logprobs from POS")
    gen.add_argument("--rid", action="append", help="request id (one per prompt; use it with `lmrpc abort`)")
    gen.add_argument("--priority", type=int, metavar="P",
                     help="scheduling priority: lower is admitted first among waiting requests (default 0)")
    gen.add_argument("--custom-logit-processor", metavar="NAME", help="name of a server-registered logit processor")
    gen.add_argument("--lora", action="append", metavar="ADAPTER",
                     help="LoRA adapter (a loaded name, or a path under the server's --lora-root): once for every "
                          "prompt, or once per prompt ('' for the base model)")
    gen.add_argument("--image", action="append", metavar="FILE|URL",
                     help="an image for the prompt's next image placeholder (repeatable; with several prompts, every "
                          "prompt gets them): a local file is read and sent, an http(s) or data: URL is sent for the "
                          "server to fetch")
    gen.add_argument("--audio", action="append", metavar="FILE|URL", help="an audio clip, as --image")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object per output (per message with --stream) instead of text")
    gen.set_defaults(command=cmd_generate)

    info = sub.add_parser("info", parents=[common], help="describe the served model")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(command=cmd_info)

    tok = sub.add_parser("tokenize", parents=[common], help="print the token ids of TEXT")
    tok.add_argument("text", help="text to tokenize")
    tok.add_argument("--no-special-tokens", action="store_true", help="do not add special tokens such as BOS")
    tok.set_defaults(command=cmd_tokenize)

    detok = sub.add_parser("detokenize", parents=[common], help="print the text of token IDS")
    detok.add_argument("ids", nargs="+", type=int, metavar="ID", help="token ids")
    detok.add_argument("--keep-special-tokens", action="store_true", help="keep special tokens in the text")
    detok.set_defaults(command=cmd_detokenize)

    health = sub.add_parser("health", parents=[common], help="check (or wait for) grpc.health.v1 SERVING",
                            description="Print the serving status; exit 0 only if SERVING.")
    health.add_argument("--wait", type=float, metavar="SECONDS",
                        help="retry until SERVING for at most SECONDS (while the server starts or loads the model)")
    health.add_argument("--service", default="", help='service name to check (default "": the whole server)')
    health.set_defaults(command=cmd_health)

    load = sub.add_parser("load", parents=[common], help="the server's load (GetLoad)",
                          description="Print the server's load: outputs running, waiting and paused, KV-cache use, "
                                      "tokens per second and median queue time over the last minute, memory.")
    load.add_argument("--json", action="store_true", help="print JSON")
    load.set_defaults(command=cmd_load)

    abort = sub.add_parser("abort", parents=[common], help="abort running or queued requests")
    abort.add_argument("rid", nargs="*", help="request ids to abort")
    abort.add_argument("--all", action="store_true", help="abort every request")
    abort.set_defaults(command=cmd_abort)

    # The connection flags go on each lora command (`lmrpc lora list --target H:P`, as on every other command), not
    # on `lora` itself: argparse would let the command's defaults overwrite what was given before it.
    lora = sub.add_parser("lora", help="LoRA adapters: list, load or unload")
    lora_sub = lora.add_subparsers(dest="lora_command", required=True)
    lora_list = lora_sub.add_parser("list", parents=[common], help="the loaded adapters")
    lora_list.add_argument("--json", action="store_true", help="print JSON")
    lora_load = lora_sub.add_parser("load", parents=[common],
                                    help="load an adapter directory (server flag --enable-lora-admin)")
    lora_load.add_argument("name", help="the name requests will give")
    lora_load.add_argument("path", help="the adapter's directory, under the server's --lora-root")
    lora_unload = lora_sub.add_parser("unload", parents=[common],
                                      help="unload an adapter (server flag --enable-lora-admin)")
    lora_unload.add_argument("name", help="the loaded adapter's name")
    lora.set_defaults(command=cmd_lora)

    cli_openai.add_parsers(sub, common)
    return parser


def channel_credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """TLS credentials from the --tls* flags, or None (plaintext) when none is given."""
    if not (args.tls or args.tls_ca or args.tls_cert or args.tls_key):
        return None
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key must be given together")
    try:
        return tls(ca_cert=args.tls_ca, client_cert=args.tls_cert, client_key=args.tls_key)
    except ValueError as e:  # tls() names its parameters; name the flags instead
        flags = {"ca_cert": "--tls-ca", "client_cert": "--tls-cert", "client_key": "--tls-key"}
        raise ValueError(re.sub(r"\b(ca_cert|client_cert|client_key)\b", lambda m: flags[m.group(1)], str(e))) from None


def sampling_params_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling_params dict of `lmrpc generate`: --sampling-params JSON, then the flags given on top."""
    params: dict[str, Any] = json.loads(args.sampling_params) if args.sampling_params else {}
    if not isinstance(params, dict):
        raise ValueError("--sampling-params must be a JSON object")
    for name in ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "frequency_penalty", "presence_penalty", "min_new_tokens", "sampling_seed", "stop_token_ids",
                 "ignore_eos", "n", "regex"):
        value = getattr(args, name)
        if value is not None:
            params[name] = value
    if args.stop:
        params["stop"] = [unescape(s) for s in args.stop]
    if args.json_schema is not None:
        params["json_schema"] = file_or_text(args.json_schema)
    if args.json_object:
        params["json_schema"] = json.dumps({"type": "object"})
    if args.ebnf is not None:
        params["ebnf"] = file_or_text(args.ebnf)
    return params


def cli_media(values: list[str] | None) -> list[str | bytes] | None:
    """--image/--audio values: URLs as given (the server fetches them), anything else a local file read here (so
    the server needs no access to the caller's files)."""
    if not values:
        return None
    return [v if re.match(r"(?i)(https?|data|file):", v) else Path(v).read_bytes() for v in values]


def cmd_generate(client: Client, args: argparse.Namespace) -> int:
    params = sampling_params_from_args(args)
    kwargs: dict[str, Any] = {
        "sampling_params": params, "rid": args.rid, "return_logprob": args.logprobs,
        "top_logprobs_num": args.top_logprobs, "logprob_start_len": args.logprob_start_len,
        "custom_logit_processor": args.custom_logit_processor, "priority": args.priority, "lora_path": args.lora,
        "image_data": cli_media(args.image), "audio_data": cli_media(args.audio),
    }
    prompts: list[str] = args.prompt
    text: str | list[str] = prompts[0] if len(prompts) == 1 else prompts
    out = sys.stdout
    if not args.stream:
        results = client.generate(text, **kwargs)
    elif args.json:
        deltas = []
        for delta in client.generate(text, stream=True, **kwargs):
            print_json(delta, out)
            deltas.append(delta)
        results = merge(deltas)
    else:
        single = len(prompts) * int(params.get("n") or 1) == 1
        results = _stream_text(client.generate(text, stream=True, **kwargs), single=single, out=out)
    if not args.stream:
        for r in results:
            if args.json:
                print_json(r, out)
            else:
                _print_text(r, single=len(results) == 1, out=out)
    for r in results:
        _print_summary(r, len(results), sys.stderr)
    return EXIT_FAILED if any(r.finish.reason is FinishReason.ERROR for r in results) else EXIT_OK


def _stream_text(deltas: Iterable[GenerateDelta], *, single: bool, out: TextIO) -> list[GenerateResult]:
    """Print a single output as it streams; several outputs are printed each whole as it finishes (so that their
    texts do not interleave)."""
    results: dict[int, GenerateResult] = {}
    for delta in deltas:
        result = results.setdefault(delta.index, GenerateResult(index=delta.index, rid=delta.rid))
        result.add(delta)
        if single:
            out.write(delta.text)
            out.flush()
        elif delta.finish is not None:
            _print_text(result, single=False, out=out)
    if single:
        out.write("\n")
        out.flush()
    return [results[i] for i in sorted(results)]


def _print_text(result: GenerateResult, *, single: bool, out: TextIO) -> None:
    if not single:
        out.write(f"--- output {result.index} (rid {result.rid}) ---\n")
    out.write(result.text + "\n")
    out.flush()


def _print_summary(result: GenerateResult, count: int, err: TextIO) -> None:
    finish = result.finish
    line = f"[{result.index}] " if count > 1 else ""
    line += f"finish: {finish.reason.name.lower()}"
    if finish.matched is not None:
        line += f" (matched {finish.matched!r})"
    if finish.message:
        line += f": {finish.message}"
    if result.usage is not None:
        u = result.usage
        line += f"; usage: prompt {u.prompt_tokens}, completion {u.completion_tokens}, cached {u.cached_tokens}"
    print(line, file=err)


def cmd_info(client: Client, args: argparse.Namespace) -> int:
    info = client.model_info()
    if args.json:
        print_json(info, sys.stdout)
        return EXIT_OK
    for f in dataclasses.fields(info):
        value = getattr(info, f.name)
        print(f"{f.name}: {json.dumps(value) if isinstance(value, (dict, list)) else value}")
    return EXIT_OK


def cmd_load(client: Client, args: argparse.Namespace) -> int:
    load = client.get_load()
    if args.json:
        print_json(load, sys.stdout)
        return EXIT_OK
    for f in dataclasses.fields(load):
        print(f"{f.name}: {getattr(load, f.name)}")
    return EXIT_OK


def cmd_tokenize(client: Client, args: argparse.Namespace) -> int:
    print(*client.tokenize(args.text, add_special_tokens=not args.no_special_tokens))
    return EXIT_OK


def cmd_detokenize(client: Client, args: argparse.Namespace) -> int:
    print(client.detokenize(args.ids, skip_special_tokens=not args.keep_special_tokens))
    return EXIT_OK


def cmd_health(client: Client, args: argparse.Namespace) -> int:
    if args.wait is not None:
        client.wait_until_ready(args.wait, service=args.service)
    status = client.health(args.service)
    print(status.name)
    return EXIT_OK if status is ServingStatus.SERVING else EXIT_FAILED


def cmd_lora(client: Client, args: argparse.Namespace) -> int:
    if args.lora_command == "load":
        adapters = [client.load_lora_adapter(args.name, args.path)]
    elif args.lora_command == "unload":
        client.unload_lora_adapter(args.name)
        return EXIT_OK
    else:
        adapters = client.list_lora_adapters()
        if args.json:
            for adapter in adapters:
                print_json(adapter, sys.stdout)
            return EXIT_OK
    for a in adapters:
        print(f"{a.name}\t{a.path}\trank {a.rank}\tscale {a.scale:g}\t{','.join(a.target_modules)}\t"
              f"in use {a.in_use}")
    return EXIT_OK


def cmd_abort(client: Client, args: argparse.Namespace) -> int:
    if not args.rid and not args.all:
        print("lmrpc abort: give request ids or --all", file=sys.stderr)
        return EXIT_USAGE
    aborted = client.abort(args.rid, abort_all=args.all)
    for rid in aborted:
        print(rid)
    if not aborted:
        print("nothing was running or queued under those ids", file=sys.stderr)
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
