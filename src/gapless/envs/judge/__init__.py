"""The LLM-judge task family: a reward model scores each completion."""
