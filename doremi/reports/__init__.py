"""What a pipeline root reports: the per-domain report, the closing summary, the guardrails and the compute ledger."""
