def build(k):
    return {"model": None}
