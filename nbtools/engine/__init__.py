"""One training step on the device: lookups, prefetch, the step ring and graphs."""
