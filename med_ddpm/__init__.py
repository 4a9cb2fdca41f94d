"""Med-DDPM: mask-conditioned 3-D DDPM."""
