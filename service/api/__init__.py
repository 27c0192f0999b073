"""The REST API: ``service.api.app.create_app`` builds it."""
