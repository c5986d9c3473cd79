"""What keeps a user's constraint from harming the server: the bounds on its text (`GrammarLimits`), checked by
linear scans before anything parses or compiles it; the deep-stack threads llguidance compiles on; compiler messages
cut down to something a user can read; `GrammarError`, which every refusal raises.

Why each piece (measured with llguidance 1.9.1, SmolLM2's tokenizer, x86-64 Linux):
- llguidance's compiler recurses in native code once per link of a chain (rule -> rule, $ref -> $ref). Past the stack
  it dies with SIGSEGV, which no exception handler can catch. On an 8 MiB stack (the main thread's here; glibc gives
  new threads as much by default) these crashed: a Lark chain `r0: "x" r1 | "y"` ... at 2,750 rules (2,625
  compiled), the same chain of terminals (what a GBNF chain becomes) at 3,621 (3,468 compiled), a chain of
  JSON-schema $refs at 938 (907 compiled). On a 256 MiB thread stack: Lark chains of 60,000 rules compiled
  (100,000 crashed), terminal chains of 60,000 compiled, $ref chains of 10,000 compiled (at 15,000 llguidance
  itself answers "schema too large"). Matching along such chains (masks, tokens) ran on the default stacks without
  a crash: the parser is iterative; only the compile recurses.
- Python's json.loads raises RecursionError past about 1,000 levels; llguidance's JSON reader (serde_json) refuses
  past 128; its Lark reader refuses parentheses nested past about 30; the GBNF-to-Lark converter (Python) recurses
  about 3 frames per parenthesis and fails near 200 levels. So depth is checked on the text, before any of them.
- llguidance's GBNF-to-Lark conversion (Python, holding the GIL) is quadratic in a chain's length: 1,000 rules 1.6 s,
  2,000 4.4 s, 5,000 about 30 s.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from queue import SimpleQueue
from typing import TypeVar, cast

from lmrpc.server.engine.types import ConstraintKind

# 256 KiB: room for a tool-calling request's schemas (OpenAI takes up to 128 tools; 2 KiB of schema each is a large
# tool). Measured at this size: 25,000 literal alternatives compile in 1.3 s, 6,000 optional properties in 7 s.
DEFAULT_MAX_GRAMMAR_BYTES = 256 * 1024
# 64 levels of JSON arrays/objects (or grammar parentheses): an object property costs two ({"properties": {...}}),
# so about 31 nested objects, three times the 10 levels OpenAI's structured outputs take; half of serde_json's 128.
DEFAULT_MAX_GRAMMAR_DEPTH = 64
# 1,000 rules (or distinct $ref targets): real grammars hold tens to a few hundred. Chains this long compile on the
# compile threads' 256 MiB stack with 10x (refs) to 60x (rules) to spare, and a GBNF chain converts in 1.6 s.
DEFAULT_MAX_GRAMMAR_RULES = 1000

# The most the limits may be raised to: past 128 levels llguidance's JSON reader refuses anyway (so a higher bound
# would only let Python's recursion be reached); 10,000 chained rules or $refs compiled on the 256 MiB stack.
MAX_GRAMMAR_DEPTH_CEILING = 128
MAX_GRAMMAR_RULES_CEILING = 10_000

# Each compile thread's stack: virtual memory, committed only as deep as a compile reaches.
COMPILE_STACK_BYTES = 256 * 1024 * 1024
# The levels a structural tag adds above its schemas: the tag object, its "structures" list, one structure object.
TAG_LEVELS = 3
MAX_MESSAGE_CHARS = 200  # a compiler message shown to users is cut to this


class GrammarError(ValueError):
    """A constraint refused: past a limit, or not compiling; the message names the kind and what is wrong."""

    def __init__(self, kind: ConstraintKind, message: str) -> None:
        super().__init__(f"invalid {kind}: {message}")
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on a constraint (json_schema, regex, ebnf, structural_tag), checked on its text before any compile."""

    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES  # the constraint text, UTF-8
    max_grammar_depth: int = DEFAULT_MAX_GRAMMAR_DEPTH  # nesting: JSON arrays/objects, grammar parentheses/brackets
    max_grammar_rules: int = DEFAULT_MAX_GRAMMAR_RULES  # EBNF/Lark rule definitions plus distinct $ref targets

    def __post_init__(self) -> None:
        if self.max_grammar_bytes < 1:
            raise ValueError(f"max_grammar_bytes must be >= 1, got {self.max_grammar_bytes}")
        if not 1 <= self.max_grammar_depth <= MAX_GRAMMAR_DEPTH_CEILING:
            raise ValueError(f"max_grammar_depth must be in [1, {MAX_GRAMMAR_DEPTH_CEILING}], "
                             f"got {self.max_grammar_depth}")
        if not 1 <= self.max_grammar_rules <= MAX_GRAMMAR_RULES_CEILING:
            raise ValueError(f"max_grammar_rules must be in [1, {MAX_GRAMMAR_RULES_CEILING}], "
                             f"got {self.max_grammar_rules}")

    def size_error(self, text: str, what: str) -> str | None:
        """Why `text` (the whole constraint, named `what`) is too large, or None."""
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_grammar_bytes:
            return f"{what} is {size} bytes; the server takes at most {self.max_grammar_bytes} (--max-grammar-bytes)"
        return None

    def json_error(self, text: str, what: str, extra_levels: int = 0, whole: str | None = None) -> str | None:
        """Why JSON text is too deep or refers to too many $ref targets, or None. Safe on any text: no parse, no
        recursion. `what` names a schema (it "nests"), `whole` all of the text (it "refers"; default `what`);
        `extra_levels`: the text's own levels above its schemas (a structural tag's)."""
        shape = json_shape(text)
        depth = shape.depth - extra_levels
        if depth > self.max_grammar_depth:
            return self._depth_message(what, depth)
        if shape.refs > self.max_grammar_rules:
            return (f"{whole or what} refers to {shape.refs} distinct $ref targets; the server takes at most "
                    f"{self.max_grammar_rules} (--max-grammar-rules)")
        return None

    def grammar_error(self, text: str) -> str | None:
        """Why a GBNF or Lark grammar nests too deep or holds too many rules, or None (no parse, no recursion)."""
        shape = grammar_shape(text)
        if shape.depth > self.max_grammar_depth:
            return self._depth_message("the grammar", shape.depth)
        rules = shape.rules + shape.refs
        if rules > self.max_grammar_rules:
            counted = " (each $ref target of its JSON schemas counted as one)" if shape.refs else ""
            return (f"the grammar holds {rules} rules{counted}; the server takes at most {self.max_grammar_rules} "
                    "(--max-grammar-rules)")
        return None

    def _depth_message(self, what: str, depth: int) -> str:
        return f"{what} nests {depth} levels deep; the server takes at most {self.max_grammar_depth} " \
               "(--max-grammar-depth)"


# ---- scans of the text ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextShape:
    depth: int  # deepest nesting of brackets outside literals
    rules: int  # rule definitions (grammars; 0 for JSON)
    refs: int  # distinct $ref targets (as written) of JSON, or of JSON embedded in a grammar (%json)


# A JSON string (escapes honoured), a bracket, or a colon. A string left open matches nothing: json.loads stops there
# too, so up to that point this scan sees the same structure json.loads would recurse on.
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}:]', re.DOTALL)
_REF_KEYS = frozenset({'"$ref"', '"$dynamicRef"', '"$recursiveRef"'})
# Lark (llguidance's dialect): strings, /regex/ literals (a `/` inside one is escaped), // comments, a rule or terminal
# defined at the start of a line (`?name`, `name[lazy]`, `NAME.2`), brackets (parentheses, [optional], %json {...}).
_LARK_TOKENS = re.compile(
    r'(?P<str>"(?:[^"\\\n]|\\.)*")|(?P<comment>//[^\n]*)|(?P<regex>/(?:[^/\\\n]|\\.)+/)'
    r"|(?P<rule>^[ \t]*[?!]?[A-Za-z_]\w*(?:\[[^\]\n]*\])?(?:\.-?\d+)?[ \t]*:(?!:))|(?P<open>[(\[{])|(?P<close>[)\]}])"
    r"|(?P<colon>:)", re.MULTILINE)
# GBNF (llama.cpp): strings, [character classes], # comments, `::=` (one per rule), parentheses.
_GBNF_TOKENS = re.compile(
    r'(?P<str>"(?:[^"\\\n]|\\.)*")|(?P<cls>\[(?:[^\]\\\n]|\\.)*\])|(?P<comment>#[^\n]*)|(?P<rule>::=)'
    r"|(?P<open>\()|(?P<close>\))")
# What llguidance takes for Lark rather than GBNF (llguidance.gbnf_to_lark.is_lark_syntax, not imported: private).
_LARK_SYNTAX = re.compile(r"(?m)^\s*(%llguidance\b|start\s*:)")


def json_shape(text: str) -> TextShape:
    depth = deepest = 0
    refs: set[str] = set()
    recent: list[str] = []  # the last two tokens: a "$ref" key and its colon
    for match in _JSON_TOKENS.finditer(text):
        token = match.group()
        if token == "[" or token == "{":
            depth += 1
            deepest = max(deepest, depth)
        elif token == "]" or token == "}":
            depth -= 1
        elif token[0] == '"' and len(recent) == 2 and recent[1] == ":" and recent[0] in _REF_KEYS:
            refs.add(token)
        recent = [recent[-1], token] if recent else [token]
    return TextShape(deepest, 0, len(refs))


def grammar_shape(text: str) -> TextShape:
    """Depth, rules and $refs of a grammar, Lark or GBNF as llguidance would read it."""
    lark = _LARK_SYNTAX.search(text) is not None
    depth = deepest = rules = 0
    refs: set[str] = set()
    recent: list[str] = []
    for match in (_LARK_TOKENS if lark else _GBNF_TOKENS).finditer(text):
        kind, token = match.lastgroup, match.group()
        if kind == "open":
            depth += 1
            deepest = max(deepest, depth)
        elif kind == "close":
            depth -= 1
        elif kind == "rule":
            rules += 1
        elif kind == "str" and len(recent) == 2 and recent[1] == ":" and recent[0] in _REF_KEYS:
            refs.add(token)  # a $ref of a %json schema inside a Lark grammar
        if kind != "comment":
            recent = [recent[-1], token] if recent else [token]
    return TextShape(deepest, rules, len(refs))


# ---- compiler messages ----------------------------------------------------------------------------------------------

# A source excerpt (`   1 | start: ...`) or a caret line under it.
_NOISE = re.compile(r"^\s*(?:\d+ \|.*|[\s^~]*)$")
_STATE_DUMP = re.compile(r"^\s*<", re.MULTILINE)  # `<state>` and all after it (`<non-verbose/>` when it is off)


def readable(message: str) -> str:
    """A compiler or matcher message on one line of at most MAX_MESSAGE_CHARS: state dumps, excerpts and carets
    dropped, the `error: ...` reason of a regex message first."""
    dump = _STATE_DUMP.search(message)
    if dump:
        message = message[: dump.start()]
    lines = [line.strip() for line in message.splitlines() if not _NOISE.match(line)]
    reasons = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
    context = " ".join(line for line in lines if not line.startswith("error: "))
    text = f"{'; '.join(reasons)} ({context})" if reasons and context else "; ".join(reasons) or context
    text = " ".join(text.split()) or "rejected by the grammar compiler"
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 1] + "…"


# ---- deep-stack threads ---------------------------------------------------------------------------------------------

T = TypeVar("T")
_Job = tuple[Callable[[], object], Future[object]]
_STACK_SIZE_LOCK = threading.Lock()  # threading.stack_size is process-wide: set, start our threads, restore


class DeepStackThreads:
    """A few threads with COMPILE_STACK_BYTES of stack that run calls for others (the caller waits).

    Threads rather than a worker process: the engine needs the matcher objects themselves in its own process, and
    building one compiles the grammar again, so a process could only validate and the engine would still compile on
    its own stack. With the limits well inside what this stack takes (module docstring), a thread is safe and costs a
    hand-off (tens of microseconds). The thread count also bounds the cores hostile grammars can keep busy.
    """

    def __init__(self, name: str, count: int, stack_bytes: int = COMPILE_STACK_BYTES) -> None:
        self._jobs: SimpleQueue[_Job | None] = SimpleQueue()
        self._threads = [threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True) for i in range(count)]
        with _STACK_SIZE_LOCK:
            previous = threading.stack_size(stack_bytes)
            try:
                for thread in self._threads:
                    thread.start()  # the stack is allocated here, at the size set now
            finally:
                threading.stack_size(previous)

    def run(self, call: Callable[[], T]) -> T:
        """call() on one of the threads; its result, or its exception re-raised here."""
        future: Future[object] = Future()
        self._jobs.put((call, future))
        return cast("T", future.result())

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            call, future = job
            try:
                result = call()
            except BaseException as exc:  # noqa: BLE001 (not swallowed: run() re-raises it in the caller)
                future.set_exception(exc)
            else:
                future.set_result(result)

    def shutdown(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()


_shared: dict[str, DeepStackThreads] = {}
_shared_lock = threading.Lock()


def shared_threads(name: str, count: int) -> DeepStackThreads:
    """The process's deep-stack threads of that name, started on first use (every GrammarBackend shares them: tests
    build many backends, and the stacks' address space is not free)."""
    with _shared_lock:
        if name not in _shared:
            _shared[name] = DeepStackThreads(name, count)
        return _shared[name]
