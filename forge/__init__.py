"""forge: asynchronous RL post-training of language models on Monarch actors."""
