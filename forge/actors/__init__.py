"""RL actors: generator, trainer, reference model, replay buffer, rewards."""
