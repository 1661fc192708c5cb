"""Reinforcement learning from rewards: rollouts by the run's own engine, reward functions, prompts."""
