"""Running a model over a cache: loading models and prompts, prefill, the engines of a question's pass and decode
steps, stored tiers."""
