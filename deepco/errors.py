"""The one base class for errors a user can fix: the CLI prints them as one line and exits non-zero."""


class UserError(Exception):
    """Bad input (a file, a flag, a model) described in words the user can act on."""
