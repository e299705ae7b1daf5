"""The experiment presets that ship with the package."""
