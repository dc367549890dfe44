"""The patch options: the config (each option declared once), the registry of methods of key parts and the
vocabulary they are declared in, their command-line flags, the scale laws, argument checks."""
