"""Speech models (mlx-audio): speech to text and text to speech."""
