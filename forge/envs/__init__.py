"""Environments: the protocol a multi-turn episode follows, tools, and the sandbox code tools
run in. Plain Python; the EnvironmentActor (forge.actors) serves them."""
