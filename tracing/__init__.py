"""Tracing DeepSeek-V3.2-Exp: hook points recorded into a Trace, tidy tables, and the CLI."""
