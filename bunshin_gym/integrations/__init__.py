"""Drop-in adapters of bunshin-gym envs for other agent-RL code bases (TRL, OpenEnv, SkyRL, verl)."""
