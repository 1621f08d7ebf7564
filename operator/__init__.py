"""tidegate.operator: the kopf operator that reconciles LLMDeployment resources."""
