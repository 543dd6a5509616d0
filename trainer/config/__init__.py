"""A trainer config: its typed dataclasses, the tools that read and check them, presets and the launch environment."""
