"""Registration algorithms: each a pure function returning a RegistrationResult."""
