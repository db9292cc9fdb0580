"""Side-by-side measurements: the engine vs. plain diffusers vs. pure model compute."""
