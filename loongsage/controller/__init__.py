"""The single controller: run loops for RL and SFT, bootstrap of base policies, evaluation."""
