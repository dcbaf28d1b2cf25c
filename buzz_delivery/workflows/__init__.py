"""The workflow engine (SPEC section 11): durable DAG runs whose ``send_message`` steps produce
deliveries through the core's public services. Install it as ``buzz_delivery.workflows`` after
``buzz_delivery`` in ``INSTALLED_APPS``. Public API: :mod:`buzz_delivery.workflows.services`."""
