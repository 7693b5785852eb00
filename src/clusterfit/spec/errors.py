class SpecError(ValueError):
    """A mistake in the user's job spec, phrased as one line that says what to fix."""
