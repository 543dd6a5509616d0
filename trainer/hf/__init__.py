"""The Hugging Face format: its tensor names, its files, and a run initialised from its weights."""
