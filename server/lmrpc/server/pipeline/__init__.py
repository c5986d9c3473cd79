"""The one request pipeline behind every front door (GenerateService, OpenAIService, SMG's worker service): a call's
validated prompts fanned out into engine requests (fanout.py), and each output's deltas gathered (gather.py). Each
service only translates its wire shapes into these and back."""
