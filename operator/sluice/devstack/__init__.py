"""Local-stack tools for development and tests (API validation like a real API server). Not imported by the operator."""
