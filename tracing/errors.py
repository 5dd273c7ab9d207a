"""Bad input: the command line turns these into exit status 2 and one line on stderr."""


class InputError(ValueError):
    """A prompt, token ids, patch, pattern or option the run cannot use."""
