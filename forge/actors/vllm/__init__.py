"""The vLLM side: the engine a Generator runs, its worker extension that loads weights, the
staged weights it swaps in, and the scorer that reads a model's logprobs."""
