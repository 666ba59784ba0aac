"""Engine integration: scheduling, trace replay and capacity planning on top of the store."""
