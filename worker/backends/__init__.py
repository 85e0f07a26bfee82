"""The only modules that import the MLX model libraries (mlx-lm, ...)."""
