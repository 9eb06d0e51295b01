"""meshtron's models and training runtime."""
