"""RL algorithm math as pure functions over tensors: advantages, policy losses, IS corrections, KL."""
