"""`LaunchError`: bad launcher input, found before any process starts.

The message is one line meant for the person who typed the command (which option or which hostfile
line, what was expected, what was given); the CLI prints it and exits with status 2.
"""

from __future__ import annotations


class LaunchError(ValueError):
    """Bad launcher input (an option, the hostfile, an env file, the script); one line, no traceback."""
