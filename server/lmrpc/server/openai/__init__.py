"""OpenAIService: OpenAI's completions and chat completions over gRPC, mapped onto the engine's requests.

validation.py turns a request into typed options (violations named by the OpenAI field), chat_template.py renders
conversations, tools.py builds tool-call constraints and parses calls, fim.py lays out fill-in-the-middle prompts,
logprobs.py writes OpenAI's logprob shapes, choices.py accumulates engine outputs into choices (best_of, usage),
completions.py and chat.py answer the two RPCs, and service.py is the servicer.
"""
