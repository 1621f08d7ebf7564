"""`tidegate router`: the prefill/decode proxy in front of disaggregated engine pools."""
