"""The pipeline and its stages: the stage functions, the checks that refuse bad input before any work, the orchestrator and what `doremi plan` plans."""
