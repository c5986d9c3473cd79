"""Python values -> lmrpc.v1 request messages.

Sampling parameters are given as dicts keyed by the proto's SamplingParams field names (the names SGLang uses),
e.g. {"max_new_tokens": 32, "temperature": 0, "stop": ["\\n"], "logit_bias": {5: 1.0}, "sampling_seed": 1}.
Only the keys given are set on the message, so the server applies its defaults to the rest; None means "unset".
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Union

from lmrpc.client.media import MediaArg, media_lists
from lmrpc.v1 import generate_pb2

# One set of sampling parameters: a dict of field names, or a ready message.
SamplingParamsLike = Union[Mapping[str, Any], generate_pb2.SamplingParams]  # noqa: UP007 (runtime alias, py3.10)

SAMPLING_FIELDS: frozenset[str] = frozenset(generate_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
CONSTRAINT_FIELDS: tuple[str, ...] = ("json_schema", "regex", "ebnf", "structural_tag")
_STRING_LISTS = ("stop", "stop_regex")  # a lone string is accepted for these


def sampling_params_to_pb(params: SamplingParamsLike) -> generate_pb2.SamplingParams:
    """Convert one set of sampling parameters; unknown keys raise TypeError, bad values TypeError/ValueError."""
    if isinstance(params, generate_pb2.SamplingParams):
        return params
    if not isinstance(params, Mapping):
        raise TypeError(f"sampling_params must be a dict or lmrpc.v1.SamplingParams, not {type(params).__name__}")
    unknown = sorted(set(params) - SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling parameter(s) {', '.join(map(repr, unknown))}; "
                        f"valid: {', '.join(sorted(SAMPLING_FIELDS))}")
    given = {k: v for k, v in params.items() if v is not None}
    constraints = [k for k in CONSTRAINT_FIELDS if k in given]
    if len(constraints) > 1:
        raise ValueError(f"at most one structured-output constraint may be set, got {', '.join(constraints)}")
    pb = generate_pb2.SamplingParams()
    for name, value in given.items():
        try:
            _set_field(pb, name, value)
        except (TypeError, ValueError) as e:
            raise type(e)(f"sampling parameter {name!r}: {e}") from e
    return pb


def _set_field(pb: generate_pb2.SamplingParams, name: str, value: Any) -> None:
    if name in _STRING_LISTS:
        pb_list = getattr(pb, name)
        pb_list.extend([value] if isinstance(value, str) else value)
    elif name == "stop_token_ids":
        pb.stop_token_ids.extend(value)
    elif name == "logit_bias":
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a dict of token id -> bias, got {type(value).__name__}")
        for token_id, bias in value.items():
            pb.logit_bias[int(token_id)] = float(bias)  # int(): JSON keys arrive as strings
    elif name == "custom_params":
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a dict, got {type(value).__name__}")
        pb.custom_params.update(value)
    elif name in ("json_schema", "structural_tag") and not isinstance(value, str):
        setattr(pb, name, json.dumps(value))  # a schema given as a dict
    else:
        setattr(pb, name, value)


def sampling_params_list(
    sampling_params: SamplingParamsLike | Sequence[SamplingParamsLike] | None,
) -> list[generate_pb2.SamplingParams]:
    """None -> [] (server defaults); one set -> [it] (for every prompt); a list -> one per prompt."""
    if sampling_params is None:
        return []
    if isinstance(sampling_params, (Mapping, generate_pb2.SamplingParams)):
        return [sampling_params_to_pb(sampling_params)]
    return [sampling_params_to_pb(p) for p in sampling_params]


def response_format(fmt: Mapping[str, Any]) -> dict[str, str]:
    """Map an OpenAI `response_format` to sampling parameters to merge into a sampling_params dict.

    {"type": "text"} -> {}; {"type": "json_object"} -> {"json_schema": '{"type": "object"}'};
    {"type": "json_schema", "json_schema": {"schema": {...}}} -> {"json_schema": <that schema as JSON>};
    {"type": "structural_tag", "structures": [...], "triggers": [...]} (SGLang's) -> {"structural_tag": <it as JSON>}.
    """
    kind = fmt.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": json.dumps({"type": "object"})}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, Mapping) or "schema" not in spec:
            raise ValueError('response_format of type "json_schema" needs {"json_schema": {"schema": {...}}}')
        schema = spec["schema"]
        return {"json_schema": schema if isinstance(schema, str) else json.dumps(schema)}
    if kind == "structural_tag":
        return {"structural_tag": json.dumps(dict(fmt))}  # the server checks structures and triggers
    raise ValueError(
        f'response_format type must be "text", "json_object", "json_schema" or "structural_tag", got {kind!r}')


def build_generate_request(
    text: str | Sequence[str] | None,
    *,
    input_ids: Sequence[int] | Sequence[Sequence[int]] | None,
    sampling_params: SamplingParamsLike | Sequence[SamplingParamsLike] | None,
    rid: str | Sequence[str] | None,
    return_logprob: bool,
    logprob_start_len: int | None,
    top_logprobs_num: int,
    token_ids_logprob: Sequence[int] | None,
    return_text_in_logprobs: bool,
    custom_logit_processor: str | None,
    stream: bool,
    priority: int | None = None,
    lora_path: str | Sequence[str] | None = None,
    image_data: MediaArg | None = None,
    audio_data: MediaArg | None = None,
) -> generate_pb2.GenerateRequest:
    """Build a GenerateRequest; a single prompt (str, or a flat list of ints) becomes a batch of one. Media: see
    media.py."""
    if (text is None) == (input_ids is None):
        raise ValueError("give exactly one of text and input_ids")
    req = generate_pb2.GenerateRequest(
        return_logprob=return_logprob,
        top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs,
        custom_logit_processor=custom_logit_processor or "",
        stream=stream,
    )
    if priority is not None:
        req.priority = priority
    if lora_path is not None:
        req.lora_path.extend([lora_path] if isinstance(lora_path, str) else lora_path)
    if text is not None:
        req.text.extend([text] if isinstance(text, str) else text)
    if input_ids is not None:
        prompts: list[int | Sequence[int]] = list(input_ids)
        flat = [t for t in prompts if isinstance(t, int)]
        if flat and len(flat) == len(prompts):
            req.input_ids.add().ids.extend(flat)  # one prompt
        elif flat:
            raise TypeError("input_ids must be a list of ints or a list of lists of ints, not a mix")
        else:
            for ids in prompts:
                if isinstance(ids, int):  # unreachable (flat is empty); narrows the type
                    raise TypeError("input_ids must be a list of ints or a list of lists of ints")
                req.input_ids.add().ids.extend(ids)
    req.sampling_params.extend(sampling_params_list(sampling_params))
    req.image_data.extend(media_lists(image_data))
    req.audio_data.extend(media_lists(audio_data))
    if rid is not None:
        req.rid.extend([rid] if isinstance(rid, str) else rid)
    if logprob_start_len is not None:
        req.logprob_start_len = logprob_start_len
    if token_ids_logprob:
        req.token_ids_logprob.extend(token_ids_logprob)
    return req
