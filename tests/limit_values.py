"""The values tests/limit_fuzz.py pushes requests past their limits with, as plain functions: counts, JSON schemas,
Structs, EBNF grammars nested or chained deep, unsatisfiable and explosive grammars, grammars of a byte size, long
strings and control characters, and where a message's string fields are."""

from __future__ import annotations

import functools
from collections.abc import Callable

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from wire_fuzz import _varint

COUNTS = (1, 10, 100, 320, 321, 1000, 10**5, 2**31 - 1)  # outputs asked for (n, best_of, prompts)
DEPTHS = (1, 10, 63, 64, 65, 100, 200, 990, 1200, 5000)  # nesting of schemas, Structs, parentheses
RULES = (10, 100, 1000, 2000, 5000)  # EBNF rules in a chain
UNITS = ("x", "ab ", "é", "日本", "../", "\\d")  # long strings' pieces: <= 3 bytes a character, 10^6 fit in 4 MiB
# Lone surrogates are left out: a protobuf string cannot carry them.
CONTROLS = ("\x00", "\x01", "\t", "\n", "\r", "\x1b", "\x7f", "\x85", "\u2028", "\ufeff")

# Unsatisfiable, self-referential and explosive grammars: refused, or generated (a few tokens) without a hang.
EDGES = (("ebnf", 'root ::= root "a"'), ("ebnf", "root ::= a\na ::= b\nb ::= a"), ("ebnf", 'root ::= "a"{1000000}'),
         ("ebnf", 'root ::= ("a" | "a")* "b"'), ("regex", r"[^\s\S]"), ("regex", "(a{1000}){1000}"),
         ("regex", "a{2147483647}"), ("regex", "(a|aa)*b"), ("regex", "(?=a)b"), ("regex", r"(a)\1"),
         ("regex", "(a*)*$"), ("regex", "[[[a"), ("json_schema", '{"not": {}}'), ("json_schema", "false"),
         ("json_schema", '{"type": "string", "minLength": 5, "maxLength": 2}'),
         ("json_schema", '{"allOf": [{"type": "string"}, {"type": "integer"}]}'), ("json_schema", '{"$ref": "#"}'),
         ("json_schema", '{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}'),
         ("json_schema", '{"type": "array", "minItems": 2147483647, "items": {"type": "string"}}'),
         ("json_schema", '{"type": "string", "pattern": "(a{1000}){1000}"}'),
         ("json_schema", '{"type": "string", "maxLength": 1e308}'), ("json_schema", '{"enum": []}'))


def around(limit: int) -> list[int]:
    """limit - 1, limit, limit + 1, 10x, 100x."""
    return [limit - 1, limit, limit + 1, 10 * limit, 100 * limit]


def ld(number: int, payload: bytes) -> bytes:
    """One length-delimited field on the wire (for what the Python message cannot build: Structs 5,000 deep)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


@functools.cache
def nested_schema(depth: int, shape: str) -> str:
    """A JSON schema `depth` objects/arrays/anyOfs deep ("mixed": objects and arrays in turn; "raw": bare brackets),
    built as text: json.dumps recurses, and so would any parser that is not careful."""
    head: list[str] = []
    tail: list[str] = []
    for i in range(depth):
        kind = shape if shape != "mixed" else ("object", "array")[i % 2]
        opening, closing = {"object": ('{"type": "object", "properties": {"a": ', '}, "required": ["a"]}'),
                            "array": ('{"type": "array", "minItems": 1, "items": ', "}"),
                            "anyOf": ('{"anyOf": [', ', {"type": "null"}]}'), "raw": ("[", "]")}[kind]
        head.append(opening)
        tail.append(closing)
    return "".join(head) + ("[]" if shape == "raw" else '{"type": "string"}') + "".join(reversed(tail))


@functools.cache
def deep_struct(depth: int) -> bytes:
    """A google.protobuf.Struct holding {"type": "object", "properties": {"a": ...}} `depth` deep, as bytes: four
    messages a level, past protobuf's parse depth (100) early."""
    def entry(key: str, value: bytes) -> bytes:  # Struct.fields map entry: key 1, Value 2
        return ld(1, ld(1, key.encode()) + ld(2, value))
    struct = entry("type", ld(3, b"string"))  # Value.string_value = 3, struct_value = 5
    for _ in range(depth):
        struct = entry("type", ld(3, b"object")) + entry("properties", ld(5, entry("a", ld(5, struct))))
    return struct


def chain_ebnf(rules: int) -> str:
    """root ::= r0; r{i} ::= "x" r{i+1} | "y": a chain `rules` deep."""
    return "\n".join(["root ::= r0", *(f'r{i} ::= "x" r{i + 1} | "y"' for i in range(rules - 1)),
                      f'r{rules - 1} ::= "y"'])


def parens(kind: str, depth: int) -> str:
    """An EBNF grammar or a regex of one "a" in `depth` parentheses."""
    inner = "(" * depth + ('"a"' if kind == "ebnf" else "a") + ")" * depth
    return f"root ::= {inner}" if kind == "ebnf" else inner


@functools.cache
def sized_grammar(kind: str, form: str, size: int) -> str:
    """A valid regex, EBNF grammar or JSON schema of `size` bytes: one literal (exactly), or an alternation of
    distinct words (about; what a compiler finds costly)."""
    if form == "alternation":
        words: list[str] = []
        total = 0
        while total < size:
            words.append(f"w{len(words)}")
            total += len(words[-1]) + 4  # the word, its separator and quotes
        if kind == "regex":
            return "|".join(words)
        if kind == "ebnf":
            return "root ::= " + " | ".join(f'"{w}"' for w in words)
        return '{"enum": [' + ", ".join(f'"{w}"' for w in words) + "]}"
    head, tail = {"regex": ("", ""), "ebnf": ('root ::= "', '"'), "json_schema": ('{"enum": ["', '"]}')}[kind]
    return head + "a" * (size - len(head) - len(tail)) + tail


def long_text(unit: str, chars: int) -> str:
    return (unit * (chars // len(unit) + 1))[:chars]


@functools.cache
def string_paths(descriptor: Descriptor, depth: int = 0) -> tuple[tuple[str, ...], ...]:
    """Every string field of a message type, and of its message fields three deep (maps and google.protobuf types
    left out: a Struct's strings are JSON, not fields of ours)."""
    paths: list[tuple[str, ...]] = []
    for f in descriptor.fields:
        if f.type == FieldDescriptor.TYPE_STRING:
            paths.append((f.name,))
        elif f.message_type is not None and depth < 3 and not f.message_type.GetOptions().map_entry and \
                not f.message_type.full_name.startswith("google.protobuf."):
            paths += [(f.name, *rest) for rest in string_paths(f.message_type, depth + 1)]
    return tuple(paths)


def set_string(msg: Message, path: tuple[str, ...], value: Callable[[str], str]) -> None:
    """Set the string at `path` (the first element of a repeated field, added where there is none) to value(its
    current text)."""
    for name in path[:-1]:
        child = getattr(msg, name)
        msg = (child[0] if len(child) else child.add()) if msg.DESCRIPTOR.fields_by_name[name].is_repeated else child
    name = path[-1]
    target = getattr(msg, name)
    if not msg.DESCRIPTOR.fields_by_name[name].is_repeated:
        setattr(msg, name, value(target))
    elif len(target):
        target[0] = value(target[0])
    else:
        target.append(value(""))
